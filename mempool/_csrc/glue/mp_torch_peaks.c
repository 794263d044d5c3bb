/* The device's statistics for PyTorch: its pool and its private pools together, each peak
 * the device's own (Note [Device peaks]).
 */
#include <pthread.h>
#include <stddef.h>
#include <string.h>

#include "mp_torch_internal.h"

/* Note [Device peaks]
 * PyTorch's statistics are the device's: its pool and the private pools of its CUDA graphs
 * and MemPools together, with one peak each. Their sum would take each pool's peak at its
 * own moment (an upper bound); the device's true peak needs the device pool's peak between
 * two changes of the private pools, which is what the pool's peak windows give (Note [Peak
 * windows], mp_inspect.c). The glue reports every allocation and free of a private pool
 * (private_event, with the device's private pools as they are after it); each report closes
 * the device pool's window, adding to the device's peaks that window's peak plus what the
 * private pools held through it (`held`, as at the report before), and the moment after
 * the change. device_stats reads the open window the same way, so its peaks are exact when
 * every change was reported (the glue reports each). The figures belong to the pool
 * registered when they were taken: a new pool in the slot starts them again. */
typedef struct device_peaks {
    mp_pool *pool;                 /* the device pool the figures are of */
    int64_t peak[MP_NSTATS];       /* the device's peaks over closed windows */
    int64_t held[MP_NSTATS];       /* the private pools' current values at the last report */
} device_peaks;

static device_peaks peaks[MP_TORCH_MAX_DEVICES];
static pthread_mutex_t peaks_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards `peaks` */

#define NCOUNTERS ((sizeof(mp_stats) - offsetof(mp_stats, num_alloc_retries)) / sizeof(uint64_t))

/* out += the current, allocated and freed figures and the counters of `in` (not its peaks). */
static void add_figures(mp_stats *out, const mp_stats *in) {
    mp_stat *o = (mp_stat *)out;
    const mp_stat *i = (const mp_stat *)in;
    for (size_t k = 0; k < MP_NSTATS; k++) {
        o[k].current += i[k].current;
        o[k].allocated += i[k].allocated;
        o[k].freed += i[k].freed;
    }
    uint64_t *oc = &out->num_alloc_retries;
    const uint64_t *ic = &in->num_alloc_retries;
    for (size_t k = 0; k < NCOUNTERS; k++) oc[k] += ic[k];
}

static void privates_sum(mp_pool *const *privates, size_t n, mp_stats *out) {
    memset(out, 0, sizeof *out);
    for (size_t k = 0; k < n; k++) {
        mp_stats s;
        mp_get_stats(privates[k], &s);
        add_figures(out, &s);
    }
}

static device_peaks *peaks_of_locked(int device, mp_pool *p) {
    device_peaks *d = &peaks[device];
    if (d->pool != p) {
        memset(d, 0, sizeof *d);
        d->pool = p;
    }
    return d;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

int mp_torch_private_event(int device, mp_pool *const *privates, size_t n) {
    WITH_SLOT(device, {
        mp_stats w, held;
        pthread_mutex_lock(&peaks_lock);
        device_peaks *d = peaks_of_locked(device, p);
        privates_sum(privates, n, &held);
        mp_stats_window(p, &w, 1);
        const mp_stat *ws = (const mp_stat *)&w, *hs = (const mp_stat *)&held;
        for (size_t k = 0; k < MP_NSTATS; k++) {
            /* the window that ends here, then the moment after the change */
            d->peak[k] = max3(d->peak[k], ws[k].peak + d->held[k], ws[k].current + hs[k].current);
            d->held[k] = hs[k].current;
        }
        pthread_mutex_unlock(&peaks_lock);
    });
    return MP_OK;
}

int mp_torch_device_stats(int device, mp_pool *const *privates, size_t n, mp_stats *out) {
    WITH_SLOT(device, {
        mp_stats held;
        pthread_mutex_lock(&peaks_lock);
        device_peaks *d = peaks_of_locked(device, p);
        privates_sum(privates, n, &held);
        mp_stats_window(p, out, 0);
        int64_t window_peak[MP_NSTATS];
        mp_stat *o = (mp_stat *)out;
        for (size_t k = 0; k < MP_NSTATS; k++) window_peak[k] = o[k].peak;
        add_figures(out, &held);
        for (size_t k = 0; k < MP_NSTATS; k++)
            o[k].peak = max3(d->peak[k], window_peak[k] + d->held[k], o[k].current);
        pthread_mutex_unlock(&peaks_lock);
    });
    return MP_OK;
}

int mp_torch_device_reset_peak_stats(int device, mp_pool *const *privates, size_t n) {
    WITH_SLOT(device, {
        mp_stats w, held;
        pthread_mutex_lock(&peaks_lock);
        device_peaks *d = peaks_of_locked(device, p);
        mp_reset_peak_stats(p);
        for (size_t k = 0; k < n; k++) mp_reset_peak_stats(privates[k]);
        privates_sum(privates, n, &held);
        mp_stats_window(p, &w, 0);
        const mp_stat *ws = (const mp_stat *)&w, *hs = (const mp_stat *)&held;
        for (size_t k = 0; k < MP_NSTATS; k++) {
            d->held[k] = hs[k].current;
            d->peak[k] = ws[k].current + hs[k].current;
        }
        pthread_mutex_unlock(&peaks_lock);
    });
    return MP_OK;
}
