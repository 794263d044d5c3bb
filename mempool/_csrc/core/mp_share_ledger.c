/* The consumers' ledger: who holds an exported block, across processes.
 *
 * Note [The consumers' ledger]
 * A producer must not reuse a block it exported while another process may still read or
 * write it, and it cannot ask those processes. So each producer pool that exports keeps a
 * ledger in shared memory (shm_open "/mempool-<pid>-<token>", unlinked when the pool
 * closes), which consumers attach to by the name in the handle: fixed slots, one per
 * exported block, each with a generation (a slot given back and taken again gets a new
 * one, so a stale handle is refused, never mistaken for the new block) and a small table of
 * holders (a process and a count). Every export adds a hold IN FLIGHT (pid 0, a ticket the
 * handle carries): the block stays pinned while the handle travels, even if the producer
 * frees it at once, as PyTorch's CUDA IPC keeps a block its sender freed. The first import
 * of that handle claims the hold for its process; later imports of the same bytes add holds
 * of their own while the slot is live. A consumer's release gives its hold back. When the
 * producer collects, it first drops the holds of processes that are gone: a consumer
 * killed without releasing does not pin the block forever. A process is its pid and its
 * start time (Note [Process identity] in common/mp_proc.c): a pid reused by a new process
 * neither keeps a dead consumer's hold alive nor adds to it or gives it back. A hold never
 * claimed (a handle that never reached anyone) pins its block until the pool closes, as in
 * PyTorch.
 *
 * Each slot has a lock word: the holding process's pid and the low 32 bits of its start
 * time, one 64-bit word so that a compare and swap takes it whole, held only for a few
 * loads and stores; a waiter that finds the holder dead takes it over, so a consumer killed
 * inside one cannot wedge the producer. (A reused pid whose start time agrees in those 32
 * bits, 2^32 ticks apart, is beyond what a lock held this briefly needs.)
 *
 * The ledger's file outlives a producer killed before its pool closed. The header names its
 * creator (pid, start time and pid namespace), so others clean up after it: a consumer that
 * attaches to the ledger of a creator that is gone refuses the import (the producer's memory
 * went with it, or is no longer its to give) and unlinks the name; one whose last attachment
 * goes while the creator is gone unlinks it too; and every mp_ledger_create first sweeps
 * /dev/shm (its first SWEEP_ENTRIES_MAX entries) and unlinks each ledger of this layout that
 * it may open and whose creator is gone, so a file no consumer attached goes at the next
 * export anywhere. Whoever loses a race finds the name unlinked already (ENOENT): fine. Only
 * a process of the creator's pid namespace judges it (Note [Process identity]): to one of
 * another namespace sharing /dev/shm (a container run with --ipc=host) the creator counts as
 * alive, so its file waits for a process of its own namespace. Holders and lock words are
 * judged by pid alone, in the judge's namespace: a consumer of another namespace cannot take
 * a host or cuda handle's descriptors (they are fetched by the producer's pid, which names
 * another process there: import_ refuses such a handle, mp_ledger_foreign), so only a sim
 * handle opens there, and its holds count as gone to the producer.
 *
 * The header carries a version: a ledger of another layout is refused whole (attach answers
 * MP_EUNSUPPORTED), never read with this one's.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mp_proc.h"
#include "mp_share.h"

#define LEDGER_MAGIC 0x52454744454c504dull   /* "MPLEDGER", little-endian */
#define LEDGER_VERSION 3
#define LOCK_START_BITS 32                   /* of the holder's start time in a lock word */
#define SHM_DIR "/dev/shm"                   /* where shm_open's names live (glibc, musl) */
#define SWEEP_ENTRIES_MAX 4096               /* directory entries one sweep reads at most */

typedef struct ledger_holder {
    uint32_t pid;      /* 0: in flight (ticket) or empty (count 0) */
    uint32_t count;
    uint64_t ticket;
    uint64_t start;    /* the pid's start time (Note [Process identity]) */
} ledger_holder;

typedef struct ledger_slot {
    uint64_t lock;     /* the holder's pid | its start time's low bits << 32; 0 when free */
    uint32_t live;     /* taken by an export, not given back */
    uint32_t pad;
    uint64_t gen;
    uint64_t next_ticket;
    ledger_holder holders[MP_LEDGER_HOLDERS];
} ledger_slot;

typedef struct ledger_header {
    uint64_t magic;
    uint32_t version, nslots;
    uint32_t creator;
    uint32_t pad;
    uint64_t creator_start;
    uint64_t creator_pidns;   /* its pid namespace (mp_proc_self_pidns); 0 unknown */
} ledger_header;

_Static_assert(__atomic_always_lock_free(sizeof(uint64_t), 0),
               "the lock word is shared between processes: it must be lock-free");

#define LEDGER_BYTES (sizeof(ledger_header) + MP_LEDGER_SLOTS * sizeof(ledger_slot))

struct mp_ledger {
    ledger_header *head;
    ledger_slot *slots;
    char name[MP_LEDGER_NAME_MAX];
    int owner;          /* the producer's: unlinked at destroy */
    int refs;           /* attachments of this process (consumers), under attached_mu */
    mp_ledger *next;    /* in `attached` */
};

/* A consumer process attaches to each producer's ledger once. */
static pthread_mutex_t attached_mu = PTHREAD_MUTEX_INITIALIZER;
static mp_ledger *attached;

/* This process, as a holder records it. */
typedef struct ledger_id {
    uint32_t pid;
    uint64_t start;
} ledger_id;

static ledger_id self_id(void) {
    return (ledger_id){(uint32_t)getpid(), mp_proc_self_start()};
}

static uint64_t lock_word(ledger_id id) {
    return (uint64_t)id.pid | (id.start << 32);
}

static int holder_alive(const ledger_holder *h) { return mp_proc_alive(h->pid, h->start, 64); }

static void slot_lock_as(ledger_slot *s, uint64_t me) {
    for (unsigned spins = 0;; spins++) {
        uint64_t seen = 0;
        if (__atomic_compare_exchange_n(&s->lock, &seen, me, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            return;
        /* A holder that died inside: take the lock over. */
        if (spins % 1024 == 1023 && seen &&
            !mp_proc_alive((uint32_t)seen, seen >> 32, LOCK_START_BITS) &&
            __atomic_compare_exchange_n(&s->lock, &seen, me, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            return;
        sched_yield();
    }
}

static void slot_lock(ledger_slot *s) { slot_lock_as(s, lock_word(self_id())); }

static void slot_unlock(ledger_slot *s) { __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE); }

static int map_ledger(int fd, mp_ledger *l) {
    void *p = mmap(NULL, LEDGER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return MP_ENOMEM;
    l->head = p;
    l->slots = (ledger_slot *)((char *)p + sizeof(ledger_header));
    return MP_OK;
}

static void sweep(void);

int mp_ledger_create(mp_ledger **out, char *name) {
    sweep();
    mp_ledger *l = calloc(1, sizeof *l);
    if (!l) return MP_ENOMEM;
    int fd = -1;
    for (int tries = 0; tries < 16 && fd < 0; tries++) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t token = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^
                         ((uint64_t)(uintptr_t)l << 3) ^ (uint64_t)tries * 0x9E3779B97F4A7C15ull;
        snprintf(l->name, sizeof l->name, "/mempool-%d-%016llx", (int)getpid(),
                 (unsigned long long)token);
        fd = shm_open(l->name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) {
        free(l);
        return MP_EUNSUPPORTED;
    }
    int rc = ftruncate(fd, (off_t)LEDGER_BYTES) == 0 ? map_ledger(fd, l) : MP_ENOMEM;
    close(fd);
    if (rc != MP_OK) {
        shm_unlink(l->name);
        free(l);
        return rc;
    }
    l->head->version = LEDGER_VERSION;
    l->head->nslots = MP_LEDGER_SLOTS;
    l->head->creator = (uint32_t)getpid();
    l->head->creator_start = mp_proc_self_start();
    l->head->creator_pidns = mp_proc_self_pidns();
    __atomic_store_n(&l->head->magic, LEDGER_MAGIC, __ATOMIC_RELEASE);
    l->owner = 1;
    memcpy(name, l->name, MP_LEDGER_NAME_MAX);
    *out = l;
    return MP_OK;
}

void mp_ledger_destroy(mp_ledger *l) {
    if (!l) return;
    /* A forked child's copy of the producer's pool leaves the producer's ledger alone. */
    if (l->head->creator == (uint32_t)getpid()) shm_unlink(l->name);
    munmap(l->head, LEDGER_BYTES);
    free(l);
}

int mp_ledger_take(mp_ledger *l, uint32_t *slot, uint64_t *gen) {
    for (uint32_t i = 0; i < MP_LEDGER_SLOTS; i++) {
        ledger_slot *s = &l->slots[i];
        if (__atomic_load_n(&s->live, __ATOMIC_RELAXED)) continue;
        slot_lock(s);
        if (!s->live) {
            s->live = 1;
            s->gen++;
            memset(s->holders, 0, sizeof s->holders);
            *slot = i;
            *gen = s->gen;
            slot_unlock(s);
            return MP_OK;
        }
        slot_unlock(s);
    }
    return MP_EBUSY;
}

/* The slot of (slot, gen), locked; NULL (nothing locked) when it is not live in that
 * generation. */
static ledger_slot *live_slot(mp_ledger *l, uint32_t slot, uint64_t gen) {
    if (!l || slot >= MP_LEDGER_SLOTS) return NULL;
    ledger_slot *s = &l->slots[slot];
    slot_lock(s);
    if (!s->live || s->gen != gen) {
        slot_unlock(s);
        return NULL;
    }
    return s;
}

static ledger_holder *free_holder(ledger_slot *s) {
    for (int i = 0; i < MP_LEDGER_HOLDERS; i++)
        if (!s->holders[i].count) return &s->holders[i];
    return NULL;
}

int mp_ledger_send(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t *ticket) {
    ledger_slot *s = live_slot(l, slot, gen);
    if (!s) return MP_EINVAL;
    ledger_holder *h = free_holder(s);
    if (h) *h = (ledger_holder){0, 1, *ticket = ++s->next_ticket};
    slot_unlock(s);
    return h ? MP_OK : MP_EBUSY;
}

int mp_ledger_collect(mp_ledger *l, uint32_t slot, uint64_t gen, int retire, size_t *holds,
                      int *retired) {
    ledger_slot *s = live_slot(l, slot, gen);
    if (!s) return MP_EINVAL;
    size_t n = 0;
    for (int i = 0; i < MP_LEDGER_HOLDERS; i++) {
        ledger_holder *h = &s->holders[i];
        if (h->count && h->pid && !holder_alive(h)) *h = (ledger_holder){0, 0, 0, 0};
        n += h->count;
    }
    *retired = retire && !n;
    if (*retired) s->live = 0;
    slot_unlock(s);
    *holds = n;
    return MP_OK;
}

static int is(const ledger_holder *h, ledger_id id) {
    return h->pid == id.pid && h->start == id.start;
}

int mp_ledger_join_as(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t ticket,
                      uint32_t pid, uint64_t start) {
    if (!pid) return MP_EINVAL;
    ledger_slot *s = live_slot(l, slot, gen);
    if (!s) return MP_EINVAL;
    ledger_id me = {pid, start};
    ledger_holder *mine = NULL, *flight = NULL;
    for (int i = 0; i < MP_LEDGER_HOLDERS; i++) {
        ledger_holder *h = &s->holders[i];
        if (!h->count) continue;
        if (is(h, me)) mine = h;
        else if (!h->pid && h->ticket == ticket) flight = h;
    }
    int rc = MP_OK;
    if (flight && mine) {   /* the ticket's hold becomes one more of this process's */
        *flight = (ledger_holder){0, 0, 0, 0};
        mine->count++;
    } else if (flight) {
        *flight = (ledger_holder){me.pid, 1, 0, me.start};
    } else if (mine) {
        mine->count++;
    } else {
        ledger_holder *h = free_holder(s);
        if (h) *h = (ledger_holder){me.pid, 1, 0, me.start};
        else rc = MP_EBUSY;
    }
    slot_unlock(s);
    return rc;
}

int mp_ledger_join(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t ticket) {
    ledger_id me = self_id();
    return mp_ledger_join_as(l, slot, gen, ticket, me.pid, me.start);
}

int mp_ledger_leave(mp_ledger *l, uint32_t slot, uint64_t gen) {
    ledger_slot *s = live_slot(l, slot, gen);
    if (!s) return MP_ENOTFOUND;
    ledger_id me = self_id();
    int rc = MP_ENOTFOUND;
    for (int i = 0; i < MP_LEDGER_HOLDERS && rc != MP_OK; i++) {
        ledger_holder *h = &s->holders[i];
        if (h->count && is(h, me)) {
            if (!--h->count) *h = (ledger_holder){0, 0, 0, 0};
            rc = MP_OK;
        }
    }
    slot_unlock(s);
    return rc;
}

void mp_ledger_lock_as(mp_ledger *l, uint32_t slot, uint32_t pid, uint64_t start) {
    if (l && slot < MP_LEDGER_SLOTS)
        slot_lock_as(&l->slots[slot], lock_word((ledger_id){pid, start}));
}

/* A name mp_ledger_create makes: "/mempool-<digits>-<16 hex digits>". */
static int well_formed(const char *name) {
    if (!name || strncmp(name, "/mempool-", 9)) return 0;
    const char *at = name + 9;
    size_t digits = strspn(at, "0123456789");
    if (!digits || digits > 10 || at[digits] != '-') return 0;
    at += digits + 1;
    return strspn(at, "0123456789abcdef") == 16 && at[16] == 0;
}

/* Whether the process that made the ledger may still run: one recorded in another pid
 * namespace than this process's, or where either is unknown, is not this process's to judge
 * (Note [Process identity] in common/mp_proc.c), and counts as alive. */
static int creator_alive(const ledger_header *h) {
    uint64_t mine = mp_proc_self_pidns();
    if (!mine || h->creator_pidns != mine) return 1;
    return mp_proc_alive(h->creator, h->creator_start, 64);
}

/* What the file behind fd holds: MP_OK for a ledger of this layout (*gone: whether its
 * creator is gone), MP_EUNSUPPORTED for one of another version, MP_EINVAL for anything else.
 * Only its header is read. */
static int check_file(int fd, int *gone) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
        (size_t)st.st_size < sizeof(ledger_header))
        return MP_EINVAL;
    ledger_header *h = mmap(NULL, sizeof *h, PROT_READ, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) return MP_EINVAL;
    int rc = MP_OK;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != LEDGER_MAGIC) rc = MP_EINVAL;
    else if (h->version != LEDGER_VERSION || h->nslots != MP_LEDGER_SLOTS ||
             (size_t)st.st_size != LEDGER_BYTES)
        rc = MP_EUNSUPPORTED;
    else
        *gone = !creator_alive(h);
    munmap(h, sizeof *h);
    return rc;
}

/* Unlink the ledgers whose creators are gone: each well-formed name among the first
 * SWEEP_ENTRIES_MAX entries of SHM_DIR that this process may open for writing (not another
 * user's) and that holds a ledger of this layout. Anything else is left; nothing fails. */
static void sweep(void) {
    int saved = errno;
    DIR *dir = opendir(SHM_DIR);
    struct dirent *e;
    for (unsigned n = 0; dir && n < SWEEP_ENTRIES_MAX && (e = readdir(dir)); n++) {
        char name[MP_LEDGER_NAME_MAX] = "/";
        size_t len = strlen(e->d_name);
        if (len + 2 > sizeof name) continue;
        memcpy(name + 1, e->d_name, len + 1);
        if (!well_formed(name)) continue;
        int fd = openat(dirfd(dir), e->d_name,
                        O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
        if (fd < 0) continue;
        int gone = 0;
        if (check_file(fd, &gone) == MP_OK && gone) unlinkat(dirfd(dir), e->d_name, 0);
        close(fd);
    }
    if (dir) closedir(dir);
    errno = saved;
}

int mp_ledger_attach(const char *name, mp_ledger **out) {
    if (!well_formed(name)) return MP_EINVAL;
    pthread_mutex_lock(&attached_mu);
    for (mp_ledger *l = attached; l; l = l->next) {
        if (!strcmp(l->name, name)) {
            int rc = creator_alive(l->head) ? MP_OK : MP_ENOTFOUND;
            if (rc == MP_OK) {
                l->refs++;
                *out = l;
            }
            pthread_mutex_unlock(&attached_mu);
            return rc;
        }
    }
    mp_ledger *l = calloc(1, sizeof *l);
    int fd = l ? shm_open(name, O_RDWR, 0) : -1;
    int gone = 0;
    int rc = !l ? MP_ENOMEM : fd < 0 ? MP_EINVAL : check_file(fd, &gone);
    if (rc == MP_OK && gone) {
        /* The producer was killed before its pool closed: nothing of it can be opened, and
         * its file is left for whoever finds it so. */
        shm_unlink(name);
        rc = MP_ENOTFOUND;
    }
    if (rc == MP_OK) rc = map_ledger(fd, l);
    if (fd >= 0) close(fd);
    if (rc == MP_OK) {
        snprintf(l->name, sizeof l->name, "%s", name);
        l->refs = 1;
        l->next = attached;
        attached = l;
        *out = l;
    } else {
        free(l);
    }
    pthread_mutex_unlock(&attached_mu);
    return rc;
}

int mp_ledger_foreign(const mp_ledger *l) {
    uint64_t mine = mp_proc_self_pidns();
    return l && mine && l->head->creator_pidns && l->head->creator_pidns != mine;
}

void mp_ledger_detach(mp_ledger *l) {
    if (!l) return;
    pthread_mutex_lock(&attached_mu);
    if (--l->refs == 0) {
        for (mp_ledger **at = &attached; *at; at = &(*at)->next) {
            if (*at == l) {
                *at = l->next;
                break;
            }
        }
        /* The last of this process's holds on a producer killed before its pool closed:
         * its file goes (ENOENT when another consumer's did already). */
        if (!creator_alive(l->head)) shm_unlink(l->name);
        munmap(l->head, LEDGER_BYTES);
        free(l);
    }
    pthread_mutex_unlock(&attached_mu);
}
