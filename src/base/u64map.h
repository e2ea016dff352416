/* A u64 -> u64 hash map: open addressing with linear probing and
 * backward-shift deletion (no tombstones), load factor ≤ 3/4. Keys are any
 * value but UINT64_MAX, which marks an empty slot. Not thread-safe; the
 * caller owns the struct (zero-initialise it; free with ap__u64map_free). */
#ifndef AP_BASE_U64MAP_H
#define AP_BASE_U64MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AP_U64MAP_EMPTY UINT64_MAX

typedef struct ap_u64map {
    uint64_t *keys; /* AP_U64MAP_EMPTY = empty slot */
    uint64_t *vals;
    size_t cap, n; /* cap is 0 or a power of two */
} ap_u64map_t;

/* Inserts or replaces. AP_EINVAL for key AP_U64MAP_EMPTY, AP_ENOMEM when
 * growing fails (the map is unchanged then). */
int ap__u64map_put(ap_u64map_t *m, uint64_t key, uint64_t val);

/* True and *val (may be NULL) set when key is present. */
bool ap__u64map_get(const ap_u64map_t *m, uint64_t key, uint64_t *val);

/* Removes key; true and *val (may be NULL) set when it was present. */
bool ap__u64map_del(ap_u64map_t *m, uint64_t key, uint64_t *val);

/* Iteration: start with *pos = 0; each call that returns true sets *key and
 * *val (either may be NULL) to the next entry. The map must not change
 * during an iteration. */
static inline bool ap__u64map_next(const ap_u64map_t *m, size_t *pos, uint64_t *key, uint64_t *val)
{
    for (; *pos < m->cap; (*pos)++) {
        if (m->keys[*pos] == AP_U64MAP_EMPTY) continue;
        if (key) *key = m->keys[*pos];
        if (val) *val = m->vals[*pos];
        (*pos)++;
        return true;
    }
    return false;
}

/* Frees the table and zeroes the struct. */
void ap__u64map_free(ap_u64map_t *m);

/* A well-mixed 64-bit hash (splitmix64's finaliser). */
static inline uint64_t ap__mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

#endif
