/* Pointer -> block map for the free path: open addressing, linear probing, backward-shift
 * deletion (no tombstones, so lookups stay short however long the pool runs).
 * Keys are block addresses (non-zero, 512-byte aligned). Not thread-safe: guarded by the
 * pool lock. */
#ifndef MP_PTRMAP_H
#define MP_PTRMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uintptr_t key;
    void *value;
} mp_ptrmap_slot;

typedef struct {
    mp_ptrmap_slot *slots;
    size_t mask;   /* capacity - 1; capacity is a power of two */
    size_t count;
    int shift;     /* 64 - log2(capacity) */
} mp_ptrmap;

int mp_ptrmap_init(mp_ptrmap *m, size_t capacity_pow2);
void mp_ptrmap_destroy(mp_ptrmap *m);
/* Make room for `more` inserts that cannot fail: afterwards mp_ptrmap_insert grows nothing
 * until they are made. MP_ENOMEM if growing failed (the map is unchanged, or larger). */
int mp_ptrmap_grow_for(mp_ptrmap *m, size_t more);
static inline int mp_ptrmap_reserve(mp_ptrmap *m, size_t more) {
    return (m->count + more) * 2 <= m->mask + 1 ? 0 : mp_ptrmap_grow_for(m, more);   /* 0: MP_OK */
}
/* Insert a key that is not present. MP_ENOMEM if growing failed (map unchanged). */
int mp_ptrmap_insert(mp_ptrmap *m, uintptr_t key, void *value);
/* Remove key and return its value, or NULL when absent. */
void *mp_ptrmap_remove(mp_ptrmap *m, uintptr_t key);
void *mp_ptrmap_get(const mp_ptrmap *m, uintptr_t key);

static inline size_t mp_ptrmap_hash(const mp_ptrmap *m, uintptr_t key) {
    return (size_t)(((uint64_t)(key >> 9) * 0x9E3779B97F4A7C15ull) >> m->shift);
}

#endif
