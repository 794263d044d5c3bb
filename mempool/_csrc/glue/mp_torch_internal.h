/* What the files of the PyTorch glue's C side share (mp_torch.c, mp_torch_api.c,
 * mp_torch_private.c, mp_torch_peaks.c); not for the C++ allocator, which sees the table only.
 */
#ifndef MP_TORCH_INTERNAL_H
#define MP_TORCH_INTERNAL_H

#include "mp_torch.h"

static inline int mp_torch_valid_device(int device) {
    return device >= 0 && device < MP_TORCH_MAX_DEVICES;
}

/* ---- mp_torch.c: the device table ---- */
/* The device's pool, entered as a rare entry point (Note [Torch table lifetime]): usable
 * until mp_torch_exit(device); NULL (and nothing to exit) for an invalid device or none. */
mp_pool *mp_torch_enter(int device);
void mp_torch_exit(int device);
/* The table's data path and look-ups (mp_torch_api fields alloc, free, find_device,
 * pool_device). */
int mp_torch_table_alloc(int device, size_t nbytes, uintptr_t stream, uintptr_t *out);
void mp_torch_table_free(int device, uintptr_t ptr);
int mp_torch_find_device(uintptr_t ptr);
int mp_torch_pool_device(const mp_pool *p);
/* The table's kind_switched: one flag per device (Note [Segment kind at run time]). */
extern int mp_torch_kind_switched_by_device[MP_TORCH_MAX_DEVICES];

/* Run the body (the arguments after the device: a block with commas is several) with the
 * device's pool `p` entered; MP_EINVAL from the enclosing function when there is none. */
#define WITH_SLOT(device, ...)                         \
    do {                                               \
        mp_pool *p = mp_torch_enter(device);           \
        if (!p) return MP_EINVAL;                      \
        __VA_ARGS__;                                   \
        mp_torch_exit(device);                         \
    } while (0)

/* ---- mp_torch_private.c: private pools (fields private_pool_create, custom_pool_create) ---- */
int mp_torch_private_pool_create(int device, mp_pool **out);
int mp_torch_custom_pool_create(int device, const mp_segment_source *src, mp_pool **out);
int mp_torch_companion_pool_create(int device, mp_pool **out);

/* ---- mp_torch_peaks.c: Note [Device peaks] (fields private_event, device_stats,
 * device_reset_peak_stats) ---- */
int mp_torch_private_event(int device, mp_pool *const *privates, size_t n);
int mp_torch_device_stats(int device, mp_pool *const *privates, size_t n, mp_stats *out);
int mp_torch_device_reset_peak_stats(int device, mp_pool *const *privates, size_t n);

#endif
