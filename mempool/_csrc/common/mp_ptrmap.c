#include "mp_ptrmap.h"

#include <stdlib.h>

#include "mp_errors.h"

int mp_ptrmap_init(mp_ptrmap *m, size_t capacity_pow2) {
    int bits = 0;
    while (((size_t)1 << bits) < capacity_pow2) bits++;
    m->slots = calloc((size_t)1 << bits, sizeof(mp_ptrmap_slot));
    if (!m->slots) return MP_ENOMEM;
    m->mask = ((size_t)1 << bits) - 1;
    m->count = 0;
    m->shift = 64 - bits;
    return MP_OK;
}

void mp_ptrmap_destroy(mp_ptrmap *m) {
    free(m->slots);
    m->slots = NULL;
    m->count = 0;
}

static void put(mp_ptrmap *m, uintptr_t key, void *value) {
    size_t i = mp_ptrmap_hash(m, key);
    while (m->slots[i].key) i = (i + 1) & m->mask;
    m->slots[i].key = key;
    m->slots[i].value = value;
    m->count++;
}

static int grow(mp_ptrmap *m) {
    mp_ptrmap bigger;
    if (mp_ptrmap_init(&bigger, (m->mask + 1) * 2) != MP_OK) return MP_ENOMEM;
    for (size_t i = 0; i <= m->mask; i++)
        if (m->slots[i].key) put(&bigger, m->slots[i].key, m->slots[i].value);
    free(m->slots);
    *m = bigger;
    return MP_OK;
}

int mp_ptrmap_grow_for(mp_ptrmap *m, size_t more) {
    while ((m->count + more) * 2 > m->mask + 1)
        if (grow(m) != MP_OK) return MP_ENOMEM;
    return MP_OK;
}

int mp_ptrmap_insert(mp_ptrmap *m, uintptr_t key, void *value) {
    /* Keep the load at or under one half: probe sequences stay one or two slots long. */
    if ((m->count + 1) * 2 > m->mask + 1 && grow(m) != MP_OK) return MP_ENOMEM;
    put(m, key, value);
    return MP_OK;
}

void *mp_ptrmap_get(const mp_ptrmap *m, uintptr_t key) {
    size_t i = mp_ptrmap_hash(m, key);
    while (m->slots[i].key) {
        if (m->slots[i].key == key) return m->slots[i].value;
        i = (i + 1) & m->mask;
    }
    return NULL;
}

void *mp_ptrmap_remove(mp_ptrmap *m, uintptr_t key) {
    size_t i = mp_ptrmap_hash(m, key);
    while (m->slots[i].key != key) {
        if (!m->slots[i].key) return NULL;
        i = (i + 1) & m->mask;
    }
    void *value = m->slots[i].value;
    /* Backward-shift: pull later entries of the probe run into the hole. */
    size_t hole = i;
    for (size_t j = (i + 1) & m->mask; m->slots[j].key; j = (j + 1) & m->mask) {
        size_t home = mp_ptrmap_hash(m, m->slots[j].key);
        /* Move j into the hole unless its home lies cyclically in (hole, j]. */
        int home_in_range = (hole <= j) ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!home_in_range) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole].key = 0;
    m->slots[hole].value = NULL;
    m->count--;
    return value;
}
