#include "base/arena.h"
#include "apiary/error.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define HUGE_THRESHOLD (4u << 20)

void *ap__big_alloc(size_t n)
{
    if (n == 0) n = 1;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE;
#endif
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    if (n >= HUGE_THRESHOLD) madvise(p, n, MADV_HUGEPAGE);
#endif
    return p;
}

void ap__big_free(void *p, size_t n)
{
    if (p) munmap(p, n ? n : 1);
}

void ap__arena_init(ap_arena_t *a)
{
    memset(a, 0, sizeof *a);
}

int ap__arena_add(ap_arena_t *a, const char *name, size_t count)
{
    if (a->base) return AP_ESTATE;
    if (!name || strlen(name) >= AP_ARENA_NAME_MAX) return AP_EINVAL;
    if (a->nviews == a->views_cap) {
        size_t cap = a->views_cap ? a->views_cap * 2 : 16;
        ap_arena_view_t *v = realloc(a->views, cap * sizeof *v);
        if (!v) return AP_ENOMEM;
        a->views = v;
        a->views_cap = cap;
    }
    const size_t align = AP_ARENA_ALIGN / sizeof(float);
    size_t off = (a->count + align - 1) / align * align;
    if (count > (SIZE_MAX / sizeof(float)) - off) return AP_ENOMEM;
    ap_arena_view_t *v = &a->views[a->nviews];
    strcpy(v->name, name);
    v->offset = off;
    v->count = count;
    a->count = off + count;
    return (int)a->nviews++;
}

int ap__arena_commit(ap_arena_t *a)
{
    if (a->base) return AP_ESTATE;
    size_t bytes = a->count * sizeof(float);
    a->base = ap__big_alloc(bytes);
    if (!a->base) return AP_ENOMEM;
    a->bytes = bytes ? bytes : 1;
    return 0;
}

float *ap__arena_ptr(const ap_arena_t *a, int view)
{
    if (!a->base || view < 0 || (size_t)view >= a->nviews) return NULL;
    return a->base + a->views[view].offset;
}

int ap__arena_find(const ap_arena_t *a, const char *name)
{
    for (size_t i = 0; i < a->nviews; i++)
        if (strcmp(a->views[i].name, name) == 0) return (int)i;
    return -1;
}

void ap__arena_free(ap_arena_t *a)
{
    ap__big_free(a->base, a->bytes);
    free(a->views);
    memset(a, 0, sizeof *a);
}
