/* The one explanation of an out-of-memory refusal (mp_core.h, "Out-of-memory diagnosis").
 *
 * Note [One OOM explainer]
 * A refusal reaches users through two front ends: the Pool's OutOfMemoryError (_pool.pxi)
 * and PyTorch's torch.OutOfMemoryError (glue/torch_allocator.cpp). Both read the same
 * record (mp_oom, one snapshot of the pool under its lock where the fallback chain gave
 * up), and both explain it here: which limit refused, whether free memory is fragmented,
 * and which option would help. Two copies of these rules had drifted apart (one tested the
 * cached bytes against the rounded block, the other against the bytes asked for, on figures
 * read after the lock was dropped), so one failure was explained two ways. The text is
 * formatted here too; only the names of options differ between the front ends, because a
 * Pool takes keyword arguments and PyTorch's users set MEMPOOL_CONF or the memory fraction.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "mp_internal.h"

void mp_oom_explain(const mp_oom *rec, const mp_config *cfg, mp_oom_diagnosis *out) {
    memset(out, 0, sizeof *out);
    if (rec->code != MP_ENOMEM && rec->code != MP_ELIMIT) {
        out->refused_by = MP_OOM_BY_UPSTREAM;
        out->advice = MP_OOM_ADVICE_NONE;
        return;
    }
    if (rec->code == MP_ELIMIT) out->refused_by = MP_OOM_BY_LIMIT;
    else if (rec->nbytes > MP_MAX_ALLOC) out->refused_by = MP_OOM_BY_MAX_ALLOC;
    else out->refused_by = MP_OOM_BY_DEVICE;
    /* Cached memory would hold the block, but no free block does: what is cached at the
     * refusal is what no release could return (free blocks inside segments that hold live
     * ones), so this is fragmentation. */
    out->fragmented = rec->cached_bytes >= rec->rounded && rec->largest_free_block < rec->rounded;
    if (out->fragmented && !cfg->expandable_segments)
        out->advice = rec->code == MP_ELIMIT ? MP_OOM_ADVICE_EXPANDABLE_OR_LIMIT
                                             : MP_OOM_ADVICE_EXPANDABLE;
    else if (rec->code == MP_ELIMIT)
        out->advice = MP_OOM_ADVICE_RAISE_LIMIT;
    else if (cfg->max_split_size != MP_UNLIMITED && rec->cached_bytes >= rec->rounded)
        out->advice = MP_OOM_ADVICE_MAX_SPLIT;
    else if (rec->nbytes > MP_MAX_ALLOC)
        out->advice = MP_OOM_ADVICE_REDUCE_REQUEST;
    else
        out->advice = MP_OOM_ADVICE_FREE_MEMORY;
    /* Note [Graph capture]: whatever else holds, nothing was released or waited for. */
    if (rec->capturing) out->advice = MP_OOM_ADVICE_CAPTURE;
}

/* ---------------------------------------------------------------- formatting */

/* Appends to a fixed buffer, always terminated; `len` counts what would have been written,
 * as snprintf does, so the caller can tell a cut message. */
typedef struct {
    char *buf;
    size_t cap, len;
} text;

__attribute__((format(printf, 2, 3))) static void put(text *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = t->len < t->cap ? t->cap - t->len : 0;
    int n = vsnprintf(room ? t->buf + t->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0) t->len += (size_t)n;
}

static const struct {
    const char *name;
    size_t scale;
} units[] = {{"TiB", (size_t)1 << 40}, {"GiB", (size_t)1 << 30}, {"MiB", (size_t)1 << 20},
             {"KiB", (size_t)1 << 10}};

/* n with a comma between each group of three digits: "4,284,481,536". */
static void put_grouped(text *t, size_t n) {
    char digits[32];
    int len = snprintf(digits, sizeof digits, "%zu", n);
    for (int i = 0; i < len; i++) {
        if (i && (len - i) % 3 == 0) put(t, ",");
        put(t, "%c", digits[i]);
    }
}

static void put_bytes(text *t, size_t n, int exact) {
    for (size_t u = 0; u < sizeof units / sizeof units[0]; u++) {
        if (n < units[u].scale) continue;
        put(t, "%.2f %s", (double)n / (double)units[u].scale, units[u].name);
        if (exact) {
            put(t, " (");
            put_grouped(t, n);
            put(t, " bytes)");
        }
        return;
    }
    put(t, n == 1 ? "%zu byte" : "%zu bytes", n);
}

size_t mp_format_bytes(size_t nbytes, int exact, char *buf, size_t buflen) {
    text t = {buf, buflen, 0};
    if (buflen) buf[0] = '\0';
    put_bytes(&t, nbytes, exact);
    return t.len;
}

/* The options a hint names, as each front end spells them. */
typedef struct {
    const char *expandable;   /* how to turn expandable segments on */
    const char *limit;        /* the limit to raise */
    const char *others;       /* how to make room on a shared device */
} option_names;

static const option_names names[] = {
    [MP_OOM_WORDS_POOL] = {"expandable_segments=True", "'limit'",
                           "set 'limit' on other pools sharing the device"},
    [MP_OOM_WORDS_TORCH] = {"expandable_segments:True in MEMPOOL_CONF",
                            "the limit (set_per_process_memory_fraction or the pool's 'limit')",
                            "cap other processes on the device"},
};

static void put_advice(text *t, const mp_oom *rec, const mp_oom_diagnosis *d,
                       const option_names *o) {
    switch (d->advice) {
    case MP_OOM_ADVICE_EXPANDABLE:
    case MP_OOM_ADVICE_EXPANDABLE_OR_LIMIT:
        put(t, "free memory is fragmented (");
        put_bytes(t, rec->cached_bytes, 0);
        put(t, " cached, but no free block holds ");
        put_bytes(t, rec->rounded, 0);
        put(t, "): %s lets free neighbours merge", o->expandable);
        if (d->advice == MP_OOM_ADVICE_EXPANDABLE_OR_LIMIT) put(t, ", or raise %s", o->limit);
        break;
    case MP_OOM_ADVICE_RAISE_LIMIT:
        put(t, "raise %s, or free memory", o->limit);
        break;
    case MP_OOM_ADVICE_MAX_SPLIT:
        put(t, "cached blocks are held by max_split_size; raise it or call empty_cache()");
        break;
    case MP_OOM_ADVICE_REDUCE_REQUEST:
        put(t, "reduce the request");
        break;
    case MP_OOM_ADVICE_CAPTURE:
        put(t, "a CUDA graph capture was under way, during which the pool releases no cached "
               "memory and waits for no stream; allocate what the graph needs before "
               "capturing (a warm-up run), or free memory first");
        break;
    default:
        put(t, "free memory, reduce the request, or %s", o->others);
        break;
    }
}

size_t mp_oom_message(mp_pool *p, const mp_oom *rec, const char *backend, int device, int words,
                      char *buf, size_t buflen) {
    text t = {buf, buflen, 0};
    if (buflen) buf[0] = '\0';
    const option_names *o = &names[words == MP_OOM_WORDS_TORCH ? MP_OOM_WORDS_TORCH
                                                               : MP_OOM_WORDS_POOL];
    mp_oom_diagnosis d;
    mp_oom_explain(rec, mp_pool_config(p), &d);
    if (d.refused_by == MP_OOM_BY_UPSTREAM) {
        put(&t, "allocating ");
        put_bytes(&t, rec->nbytes, 1);
        put(&t, " on stream 0x%" PRIxPTR " failed in the %s upstream (error %d, native error %d)",
            rec->stream, backend, rec->code, mp_pool_upstream(p)->last_error);
        return t.len;
    }
    put(&t, "out of memory: tried to allocate ");
    put_bytes(&t, rec->nbytes, 1);
    put(&t, ", rounded to ");
    put_bytes(&t, rec->rounded, 0);
    put(&t, ", on stream 0x%" PRIxPTR "; refused by ", rec->stream);
    if (d.refused_by == MP_OOM_BY_LIMIT) {
        put(&t, "the pool's limit of ");
        put_bytes(&t, rec->limit, 1);
        put(&t, ", on a device of capacity ");
        put_bytes(&t, rec->capacity, 0);
    } else if (d.refused_by == MP_OOM_BY_MAX_ALLOC) {
        put(&t, "the largest request accepted (");
        put_bytes(&t, MP_MAX_ALLOC, 0);
        put(&t, ")");
    } else {
        put(&t, "%s device %d (capacity ", backend, device);
        put_bytes(&t, rec->capacity, 0);
        if (rec->limit != MP_UNLIMITED) {
            put(&t, ", pool limit ");
            put_bytes(&t, rec->limit, 0);
        }
        put(&t, ")");
    }
    put(&t, "; the pool has ");
    put_bytes(&t, rec->reserved_bytes, 0);
    put(&t, " reserved, ");
    put_bytes(&t, rec->used_bytes, 0);
    put(&t, " used, ");
    put_bytes(&t, rec->cached_bytes, 0);
    put(&t, " cached, largest free block ");
    put_bytes(&t, rec->largest_free_block, 0);
    put(&t, ". Hint: ");
    put_advice(&t, rec, &d, o);
    put(&t, ".");
    return t.len;
}
