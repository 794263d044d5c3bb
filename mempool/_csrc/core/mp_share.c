/* Sharing blocks with other processes: the handle of a block's memory, and the regions this
 * pool has open of other pools' handles.
 *
 * Note [Sharing across processes]
 * A process hands a block to another one by a handle: bytes it can send through a pipe or a
 * pickle. The handle names the REGION that holds the block, not the block: the whole
 * segment, or on an expandable range the run of whole physical allocations that covers the
 * block (a driver exports and maps physical allocations only whole, and a live block keeps
 * every allocation it touches mapped: Note [Growth extents] in mp_expand.c). So every block
 * of one region gives equal bytes, and mp_share returns the block's offset in the region
 * beside them. The bytes are a header the core writes and checks, then the upstream's
 * payload (mp_upstream.h's share/open/close):
 *     "MPSH", u8 version, u8 name length + the upstream's name, u32 device (0: the core does
 *     not know it), u32 producer pid, u64 region base in the producer, u64 region bytes,
 *     u8 expandable, u32 payload length, payload
 * little-endian. A consumer's pool opens a handle once and counts later opens of equal bytes
 * (one mapping per region, however many blocks of it come over); the upstream makes its
 * payload differ whenever the memory differs (a serial per allocation), so equal bytes mean
 * the same memory. Everything a consumer is given is checked before the upstream sees it
 * (lengths, magic, version, the upstream's name against the pool's own, sizes): bytes
 * mp_share did not make are MP_EINVAL, never a crash.
 *
 * What the core does not do: keep the block live while consumers use it. The handle is
 * valid while the block is live in the producer; the Python layer (mempool/_share.pxi) pins
 * exported blocks until the consumers' ledger (mp_share_ledger.c) says every consumer let
 * go. The core's lock is held only to find the block and its region and to update the open
 * table: the upstream's share, open and close (a driver call, a pidfd, an mmap) run without
 * it, as every upstream call does (Note [Lock order], mp_core.c). Share may run without the
 * lock because the caller keeps the block live meanwhile, so its region stays allocated.
 * Sync points: mp_share does not wait for the block's stream; the caller does (a consumer
 * must see finished writes), and a consumer waits for its own stream before it lets go.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mp_block.h"
#include "mp_internal.h"
#include "mp_share.h"

#define MP_SHARE_MAGIC "MPSH"
#define MP_SHARE_VERSION 2   /* the upstreams' payloads carry a secret per descriptor */

struct mp_share_open {
    unsigned char *bytes;   /* the handle, as opened */
    size_t len;
    uintptr_t base;         /* where it is mapped here */
    size_t nbytes;
    size_t count;           /* opens not yet closed */
};

/* ---- encoding ---------------------------------------------------------------------------- */

static unsigned char *put_u(unsigned char *at, uint64_t v, int n) {
    for (int i = 0; i < n; i++) at[i] = (unsigned char)(v >> (8 * i));
    return at + n;
}

static uint64_t get_u(const unsigned char *at, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)at[i] << (8 * i);
    return v;
}

/* The header's length for an upstream named `name` (the payload's length not included). */
static size_t header_len(size_t namelen) {
    return 4 + 1 + 1 + namelen + 4 + 4 + 8 + 8 + 1 + 4;
}

typedef struct share_header {
    const char *name;       /* the upstream's name, namelen bytes, in the handle */
    size_t namelen;
    uint64_t base, nbytes;
    int expandable;
    const unsigned char *payload;
    size_t payload_len;
} share_header;

/* Parse and check the header of `len` bytes at buf, whatever upstream wrote it: MP_EINVAL
 * for anything mp_share would not have written, MP_EUNSUPPORTED for a handle of another
 * version of this format. out->name is the upstream's name, not NUL-terminated
 * (out->namelen bytes). */
static int parse_any_header(const unsigned char *buf, size_t len, share_header *out) {
    if (!buf || len < header_len(0) || len > MP_SHARE_HANDLE_MAX) return MP_EINVAL;
    if (memcmp(buf, MP_SHARE_MAGIC, 4)) return MP_EINVAL;
    if (buf[4] != MP_SHARE_VERSION) return MP_EUNSUPPORTED;
    size_t namelen = buf[5];
    if (namelen > MP_SHARE_NAME_MAX || len < header_len(namelen)) return MP_EINVAL;
    out->name = (const char *)buf + 6;
    out->namelen = namelen;
    const unsigned char *at = buf + 6 + namelen + 4 + 4;     /* device, pid: informative */
    out->base = get_u(at, 8);
    out->nbytes = get_u(at + 8, 8);
    if (at[16] > 1) return MP_EINVAL;
    out->expandable = at[16];
    uint64_t plen = get_u(at + 17, 4);
    if (plen != len - header_len(namelen)) return MP_EINVAL;
    /* A region is at least one 512-byte unit and fits the address space with its base. */
    if (out->nbytes < 512 || out->nbytes % 512 || out->nbytes > (SIZE_MAX >> 2) ||
        out->base > UINTPTR_MAX - out->nbytes)
        return MP_EINVAL;
    out->payload = buf + header_len(namelen);
    out->payload_len = (size_t)plen;
    return MP_OK;
}

/* parse_any_header, for a handle an upstream named `name` must have written. */
static int parse_header(const char *name, const unsigned char *buf, size_t len,
                        share_header *out) {
    if (parse_any_header(buf, len, out) != MP_OK) return MP_EINVAL;
    size_t namelen = strlen(name);
    if (out->namelen != namelen || memcmp(out->name, name, namelen))
        return MP_EINVAL;   /* another kind of upstream */
    return MP_OK;
}

int mp_share_region(const unsigned char *buf, size_t len, char *name, size_t namecap,
                    uint64_t *nbytes) {
    share_header h;
    if (!name || !nbytes) return MP_EINVAL;
    int rc = parse_any_header(buf, len, &h);
    if (rc != MP_OK) return rc;
    if (namecap <= h.namelen) return MP_EINVAL;
    memcpy(name, h.name, h.namelen);
    name[h.namelen] = '\0';
    *nbytes = h.nbytes;
    return MP_OK;
}

/* ---- the producer's side ------------------------------------------------------------------ */

/* The region holding live block b: its segment whole, or on an expandable range the run of
 * physical allocations (extents) covering it. 0 when the extents do not cover it (never for
 * a live block: its pages are mapped). */
static int region_of_locked(const mp_block *b, uintptr_t *base, size_t *nbytes, int *exp) {
    const mp_segment *seg = b->seg;
    if (!seg->expandable) {
        *base = seg->ptr;
        *nbytes = seg->nbytes;
        *exp = 0;
        return 1;
    }
    uintptr_t end = b->ptr + b->nbytes;
    size_t i = 0;
    while (i < seg->nextents && seg->extents[i].ptr + seg->extents[i].nbytes <= b->ptr) i++;
    if (i == seg->nextents || seg->extents[i].ptr > b->ptr) return 0;
    uintptr_t start = seg->extents[i].ptr, reach = start;
    for (; i < seg->nextents && reach < end; i++) {
        if (seg->extents[i].ptr != reach) return 0;   /* a hole: not mapped */
        reach += seg->extents[i].nbytes;
    }
    if (reach < end) return 0;
    *base = start;
    *nbytes = (size_t)(reach - start);
    *exp = 1;
    return 1;
}

int mp_share(mp_pool *p, uintptr_t ptr, unsigned char *buf, size_t cap, size_t *len,
             size_t *offset) {
    if (!len || !offset || (cap && !buf)) return MP_EINVAL;
    if (!p->up.share) return MP_EUNSUPPORTED;
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    mp_block *b = mp_live_block_locked(p, ptr);
    if (!b) {
        int rc = mp_classify_bad_pointer_locked(p, ptr);
        mp_lock_release(&p->lock);
        return rc == MP_OK ? MP_ENOTFOUND : rc;
    }
    uintptr_t base = 0;
    size_t nbytes = 0;
    int exp = 0;
    int found = region_of_locked(b, &base, &nbytes, &exp);
    mp_lock_release(&p->lock);
    if (!found) return MP_EINVAL;
    const char *name = p->up.name ? p->up.name : "";
    size_t namelen = strlen(name);
    if (namelen > MP_SHARE_NAME_MAX) return MP_EUNSUPPORTED;
    size_t head = header_len(namelen);
    /* The payload first, after the header's room (or into nothing, to learn its length). */
    size_t plen = 0;
    int room = cap >= head;
    int rc = p->up.share(p->up.ctx, base, nbytes, exp, room ? buf + head : NULL,
                         room ? cap - head : 0, &plen);
    if (rc == MP_EINVAL && plen) {   /* too small: the length needed */
        *len = head + plen;
        return MP_EINVAL;
    }
    if (rc != MP_OK) return rc;
    if (plen > MP_SHARE_HANDLE_MAX - head) return MP_EUPSTREAM;
    *len = head + plen;
    if (!room || cap < head + plen) return MP_EINVAL;
    unsigned char *at = buf;
    memcpy(at, MP_SHARE_MAGIC, 4);
    at[4] = MP_SHARE_VERSION;
    at[5] = (unsigned char)namelen;
    memcpy(at + 6, name, namelen);
    at += 6 + namelen;
    at = put_u(at, 0, 4);   /* the device: the upstream's payload names it where it matters */
    at = put_u(at, (uint64_t)getpid(), 4);
    at = put_u(at, base, 8);
    at = put_u(at, nbytes, 8);
    *at++ = (unsigned char)exp;
    put_u(at, plen, 4);
    *offset = (size_t)(ptr - base);
    return MP_OK;
}

int mp_share_sync(mp_pool *p, uintptr_t ptr) {
    if (!mp_lock_own(p)) return MP_EFORKED;
    mp_block *b = mp_live_block_locked(p, ptr);
    uintptr_t stream = b ? b->stream->handle : 0;
    mp_lock_release(&p->lock);
    if (!b) return MP_ENOTFOUND;
    return mp_up_sync(p, stream);   /* with the lock dropped, as every upstream call */
}

/* ---- the consumer's side ------------------------------------------------------------------ */

static struct mp_share_open *find_bytes_locked(mp_pool *p, const unsigned char *buf,
                                               size_t len) {
    for (size_t i = 0; i < p->nshare_opens; i++) {
        struct mp_share_open *o = &p->share_opens[i];
        if (o->len == len && !memcmp(o->bytes, buf, len)) return o;
    }
    return NULL;
}

int mp_share_open(mp_pool *p, const unsigned char *buf, size_t len, uintptr_t *base,
                  size_t *nbytes) {
    if (!base || !nbytes) return MP_EINVAL;
    const char *name = p->up.name ? p->up.name : "";
    share_header h;
    if (parse_header(name, buf, len, &h) != MP_OK) return MP_EINVAL;
    if (!p->up.open || !p->up.close) return MP_EUNSUPPORTED;
    if (!mp_lock_own(p)) return MP_EFORKED;
    struct mp_share_open *o = find_bytes_locked(p, buf, len);
    if (o) {
        o->count++;
        *base = o->base;
        *nbytes = o->nbytes;
        mp_lock_release(&p->lock);
        return MP_OK;
    }
    mp_lock_release(&p->lock);
    /* A copy of the bytes for the table, made before the mapping so that a failure leaves
     * nothing to undo but the copy. */
    unsigned char *copy = malloc(len);
    if (!copy) return MP_ENOMEM;
    memcpy(copy, buf, len);
    uintptr_t out = 0;
    int rc = p->up.open(p->up.ctx, h.payload, h.payload_len, (size_t)h.nbytes, &out);
    if (rc != MP_OK) {
        free(copy);
        return rc;
    }
    mp_lock_acquire(&p->lock);
    o = find_bytes_locked(p, buf, len);   /* another thread opened it meanwhile */
    if (o) {
        o->count++;
        *base = o->base;
        *nbytes = o->nbytes;
        mp_lock_release(&p->lock);
        p->up.close(p->up.ctx, out, (size_t)h.nbytes);
        free(copy);
        return MP_OK;
    }
    if (p->nshare_opens == p->cap_share_opens) {
        size_t cap = p->cap_share_opens ? 2 * p->cap_share_opens : 8;
        struct mp_share_open *grown = realloc(p->share_opens, cap * sizeof *grown);
        if (!grown) {
            mp_lock_release(&p->lock);
            p->up.close(p->up.ctx, out, (size_t)h.nbytes);
            free(copy);
            return MP_ENOMEM;
        }
        p->share_opens = grown;
        p->cap_share_opens = cap;
    }
    p->share_opens[p->nshare_opens++] =
        (struct mp_share_open){copy, len, out, (size_t)h.nbytes, 1};
    *base = out;
    *nbytes = (size_t)h.nbytes;
    mp_lock_release(&p->lock);
    return MP_OK;
}

int mp_share_close(mp_pool *p, uintptr_t base) {
    if (!mp_lock_own(p)) return MP_EFORKED;
    for (size_t i = 0; i < p->nshare_opens; i++) {
        struct mp_share_open *o = &p->share_opens[i];
        if (o->base != base) continue;
        if (--o->count) {
            mp_lock_release(&p->lock);
            return MP_OK;
        }
        struct mp_share_open gone = *o;
        p->share_opens[i] = p->share_opens[--p->nshare_opens];
        mp_lock_release(&p->lock);
        int rc = p->up.close(p->up.ctx, gone.base, gone.nbytes);
        free(gone.bytes);
        return rc;
    }
    mp_lock_release(&p->lock);
    return MP_ENOTFOUND;
}

void mp_share_close_all(mp_pool *p) {
    /* Whoever still held an open lets go with the pool: its memory is the other process's,
     * so only this process's mapping goes. */
    for (size_t i = 0; i < p->nshare_opens; i++) {
        struct mp_share_open *o = &p->share_opens[i];
        if (p->up.close) p->up.close(p->up.ctx, o->base, o->nbytes);
        free(o->bytes);
    }
    free(p->share_opens);
    p->share_opens = NULL;
    p->nshare_opens = p->cap_share_opens = 0;
}
