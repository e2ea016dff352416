/* Tensor arena: one large, 64-byte-aligned, pre-faulted float allocation
 * carved into named views. Allocate once, reuse for every round (touching
 * fresh pages costs ~30x a memcpy on these machines). Internal. */
#ifndef AP_BASE_ARENA_H
#define AP_BASE_ARENA_H

#include <stddef.h>
#include <stdint.h>

#define AP_ARENA_ALIGN    64
#define AP_ARENA_NAME_MAX 64

typedef struct ap_arena_view {
    char name[AP_ARENA_NAME_MAX];
    size_t offset; /* in floats from the arena base */
    size_t count;  /* floats */
} ap_arena_view_t;

typedef struct ap_arena {
    float *base;  /* AP_ARENA_ALIGN-aligned; NULL until ap__arena_commit */
    size_t count; /* floats in use (sum of views incl. padding) */
    size_t bytes; /* mapped bytes */
    ap_arena_view_t *views;
    size_t nviews, views_cap;
} ap_arena_t;

void ap__arena_init(ap_arena_t *a);
/* Declares a view of count floats; each view starts AP_ARENA_ALIGN-aligned.
 * Returns the view index or a negative AP_E* code. Only before commit. */
int ap__arena_add(ap_arena_t *a, const char *name, size_t count);
/* Allocates (mmap, pre-faulted, zeroed) room for all declared views. */
int ap__arena_commit(ap_arena_t *a);
float *ap__arena_ptr(const ap_arena_t *a, int view);
/* Finds a view by name; -1 if absent. */
int ap__arena_find(const ap_arena_t *a, const char *name);
void ap__arena_free(ap_arena_t *a);

/* Page-aligned, pre-faulted, zeroed allocation of n bytes (huge pages advised
 * where large). Free with ap__big_free(p, n). NULL on failure. */
void *ap__big_alloc(size_t n);
void ap__big_free(void *p, size_t n);

#endif
