/* u64 -> u64 open-addressing hash map (see u64map.h). */
#include "base/u64map.h"

#include "apiary/error.h"

#include <stdlib.h>
#include <string.h>

static size_t home(uint64_t key, size_t cap)
{
    return (size_t)ap__mix64(key) & (cap - 1);
}

static int grow(ap_u64map_t *m)
{
    size_t cap = m->cap ? m->cap * 2 : 16;
    uint64_t *keys = malloc(cap * sizeof *keys);
    uint64_t *vals = malloc(cap * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return AP_ENOMEM;
    }
    memset(keys, 0xff, cap * sizeof *keys);
    for (size_t j = 0; j < m->cap; j++) {
        if (m->keys[j] == AP_U64MAP_EMPTY) continue;
        size_t i = home(m->keys[j], cap);
        while (keys[i] != AP_U64MAP_EMPTY) i = (i + 1) & (cap - 1);
        keys[i] = m->keys[j];
        vals[i] = m->vals[j];
    }
    free(m->keys);
    free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    return 0;
}

/* The slot holding key, or the empty slot that ends its probe chain. */
static size_t find(const ap_u64map_t *m, uint64_t key)
{
    size_t mask = m->cap - 1, i = home(key, m->cap);
    while (m->keys[i] != key && m->keys[i] != AP_U64MAP_EMPTY) i = (i + 1) & mask;
    return i;
}

int ap__u64map_put(ap_u64map_t *m, uint64_t key, uint64_t val)
{
    if (key == AP_U64MAP_EMPTY) return AP_EINVAL;
    if ((m->n + 1) * 4 > m->cap * 3 && grow(m) != 0) return AP_ENOMEM;
    size_t i = find(m, key);
    if (m->keys[i] == AP_U64MAP_EMPTY) m->n++;
    m->keys[i] = key;
    m->vals[i] = val;
    return 0;
}

bool ap__u64map_get(const ap_u64map_t *m, uint64_t key, uint64_t *val)
{
    if (!m->cap || key == AP_U64MAP_EMPTY) return false;
    size_t i = find(m, key);
    if (m->keys[i] != key) return false;
    if (val) *val = m->vals[i];
    return true;
}

bool ap__u64map_del(ap_u64map_t *m, uint64_t key, uint64_t *val)
{
    if (!m->cap || key == AP_U64MAP_EMPTY) return false;
    size_t mask = m->cap - 1, i = find(m, key);
    if (m->keys[i] != key) return false;
    if (val) *val = m->vals[i];
    /* backward shift: move each later entry of the chain into the hole when
     * its home slot is not cyclically within (hole, entry] */
    for (size_t j = (i + 1) & mask; m->keys[j] != AP_U64MAP_EMPTY; j = (j + 1) & mask) {
        size_t h = home(m->keys[j], m->cap);
        bool move = (i <= j) ? (h <= i || h > j) : (h <= i && h > j);
        if (move) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->keys[i] = AP_U64MAP_EMPTY;
    m->n--;
    return true;
}

void ap__u64map_free(ap_u64map_t *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}
