/* Sharing across processes, beyond mp_core.h's mp_share*: the consumers' ledger
 * (mp_share_ledger.c) and the pool that holds an opened region as a block, so that a Buffer
 * over another process's memory is released as any block is (mp_share_import.c). Note
 * [Sharing across processes] (mp_share.c) and Note [The consumers' ledger]
 * (mp_share_ledger.c) tell the design.
 */
#ifndef MP_SHARE_H
#define MP_SHARE_H

#include <stddef.h>
#include <stdint.h>

#include "mp_core.h"

#define MP_LEDGER_NAME_MAX 64          /* with the NUL */
#define MP_LEDGER_SLOTS 2048           /* blocks one producer pool exports at once */
#define MP_LEDGER_HOLDERS 30           /* processes (and handles in flight) per block */

typedef struct mp_ledger mp_ledger;

/* The producer's: make a ledger (shm_open of a new "/mempool-<pid>-<token>"; its name into
 * name[MP_LEDGER_NAME_MAX]), after unlinking the ledgers of creators that are gone (Note [The
 * consumers' ledger]), and destroy it (unmapped and unlinked: consumers that attached keep
 * their mapping; none can attach after). */
int mp_ledger_create(mp_ledger **out, char *name);
void mp_ledger_destroy(mp_ledger *l);
/* A free slot for a block being exported: *slot and its generation *gen (the handle carries
 * both; a slot given back and taken again has a new generation). MP_EBUSY when every slot
 * is held. */
int mp_ledger_take(mp_ledger *l, uint32_t *slot, uint64_t *gen);
/* One handle sent: a hold in flight until a consumer claims it (*ticket names it). */
int mp_ledger_send(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t *ticket);
/* The holds on a slot, after dropping those of consumers that are gone (Note [Process
 * identity] in common/mp_proc.c); with retire and no hold left, the slot is given back (the block may be reused):
 * *retired = 1. MP_EINVAL for a slot of another generation. */
int mp_ledger_collect(mp_ledger *l, uint32_t slot, uint64_t gen, int retire, size_t *holds,
                      int *retired);

/* The consumer's: attach to a producer's ledger by name (counted per process: one mapping),
 * and let go. MP_EINVAL for a name no ledger has, or a file that is not one;
 * MP_EUNSUPPORTED for a ledger of another version of this layout; MP_ENOTFOUND when the
 * process that made it is gone (killed before its pool closed: the name is unlinked; only a
 * maker of this process's pid namespace is judged). The last detach of a ledger whose maker
 * is gone unlinks its name. */
int mp_ledger_attach(const char *name, mp_ledger **out);
void mp_ledger_detach(mp_ledger *l);
/* Whether the ledger's maker runs in another pid namespace than this process (both known):
 * its pid then names another process here, so nothing may be fetched from it by pid. */
int mp_ledger_foreign(const mp_ledger *l);
/* Take a hold on a slot for this process: the hold in flight that `ticket` names becomes
 * this process's, or (claimed already: the same handle opened again, or sent to several
 * processes) one more of its own. MP_EINVAL when the slot was given back or holds another
 * generation (a stale handle), MP_EBUSY when it has no room for another holder. */
int mp_ledger_join(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t ticket);
/* Give back one hold of this process's (MP_ENOTFOUND when it has none). */
int mp_ledger_leave(mp_ledger *l, uint32_t slot, uint64_t gen);

/* Test controls: mp_ledger_join for process (pid, start), and the slot's lock taken as that
 * process (left held), so that tests can plant a holder or a lock of a process whose pid
 * runs under another start time, as a reused pid does. */
int mp_ledger_join_as(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t ticket,
                      uint32_t pid, uint64_t start);
void mp_ledger_lock_as(mp_ledger *l, uint32_t slot, uint32_t pid, uint64_t start);

/* The upstream's name (NUL-terminated, at most namecap bytes with the NUL) and the region's
 * size of a handle mp_share made, checked as mp_share_open checks it, whatever the upstream:
 * MP_EINVAL for bytes mp_share did not make, MP_EUNSUPPORTED for a handle of another
 * version of the format (another version of mempool made it). For a caller that must know which backend a
 * handle is for before it opens anything. */
#define MP_SHARE_NAME_MAX 32
int mp_share_region(const unsigned char *buf, size_t len, char *name, size_t namecap,
                    uint64_t *nbytes);

/* Wait for the work queued on the stream of the live block at ptr (MP_ENOTFOUND for no live
 * block): an exporter's writes are done before a consumer reads. */
int mp_share_sync(mp_pool *p, uintptr_t ptr);

/* A pool (one reference, *out) whose one segment is the region opened at `base` (nbytes) of
 * `parent` (mp_share_open), with the parent's streams and events: its first allocation of
 * nbytes is the block at `base`. When the pool goes (its last reference), it waits for the
 * device, leaves the ledger's slot (when `ledger` is not NULL), detaches from the ledger,
 * closes the region in `parent` (mp_share_close) and drops its reference on the parent: on
 * success all of them move to the pool. On failure nothing moves. */
int mp_share_import_pool(mp_pool *parent, uintptr_t base, size_t nbytes, mp_ledger *ledger,
                         uint32_t slot, uint64_t gen, mp_pool **out);

#endif
