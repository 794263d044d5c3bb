/* The consumers' ledger: who holds an exported block, across processes.
 *
 * Note [The consumers' ledger]
 * A producer must not reuse a block it exported while another process may still read or
 * write it, and it cannot ask those processes. So each producer pool that exports keeps a
 * ledger in shared memory (shm_open "/mempool-<pid>-<token>", unlinked when the pool
 * closes), which consumers attach to by the name in the handle: fixed slots, one per
 * exported block, each with a generation (a slot given back and taken again gets a new
 * one, so a stale handle is refused, never mistaken for the new block) and a small table of
 * holders (a pid and a count). Every export adds a hold IN FLIGHT (pid 0, a ticket the
 * handle carries): the block stays pinned while the handle travels, even if the producer
 * frees it at once, as PyTorch's CUDA IPC keeps a block its sender freed. The first import
 * of that handle claims the hold for its process; later imports of the same bytes add holds
 * of their own while the slot is live. A consumer's release gives its hold back. When the
 * producer collects, it first drops the holds of processes that are gone (kill(pid, 0)
 * answers ESRCH): a consumer killed without releasing does not pin the block forever. A
 * hold never claimed (a handle that never reached anyone) pins its block until the pool
 * closes, as in PyTorch.
 *
 * Each slot has a lock word: the pid of the process holding it, taken with a compare and
 * swap and held only for a few loads and stores; a waiter that finds the holder dead takes
 * it over, so a consumer killed inside one cannot wedge the producer.
 */
#define _GNU_SOURCE
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

#include "mp_share.h"

#define LEDGER_MAGIC 0x52454744454c504dull   /* "MPLEDGER", little-endian */
#define LEDGER_VERSION 1

typedef struct ledger_holder {
    uint32_t pid;      /* 0: in flight (ticket) or empty (count 0) */
    uint32_t count;
    uint64_t ticket;
} ledger_holder;

typedef struct ledger_slot {
    uint32_t lock;     /* the holder's pid, 0 when free */
    uint32_t live;     /* taken by an export, not given back */
    uint64_t gen;
    uint64_t next_ticket;
    ledger_holder holders[MP_LEDGER_HOLDERS];
} ledger_slot;

typedef struct ledger_header {
    uint64_t magic;
    uint32_t version, nslots;
    uint32_t creator;
    uint32_t pad;
} ledger_header;

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

static int alive(uint32_t pid) {
    return !(kill((pid_t)pid, 0) != 0 && errno == ESRCH);
}

static void slot_lock(ledger_slot *s) {
    uint32_t me = (uint32_t)getpid();
    for (unsigned spins = 0;; spins++) {
        uint32_t seen = 0;
        if (__atomic_compare_exchange_n(&s->lock, &seen, me, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            return;
        /* A holder that died inside: take the lock over. */
        if (spins % 1024 == 1023 && seen && !alive(seen) &&
            __atomic_compare_exchange_n(&s->lock, &seen, me, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            return;
        sched_yield();
    }
}

static void slot_unlock(ledger_slot *s) { __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE); }

static int map_ledger(int fd, mp_ledger *l) {
    void *p = mmap(NULL, LEDGER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return MP_ENOMEM;
    l->head = p;
    l->slots = (ledger_slot *)((char *)p + sizeof(ledger_header));
    return MP_OK;
}

int mp_ledger_create(mp_ledger **out, char *name) {
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
        if (h->count && h->pid && !alive(h->pid)) *h = (ledger_holder){0, 0, 0};
        n += h->count;
    }
    *retired = retire && !n;
    if (*retired) s->live = 0;
    slot_unlock(s);
    *holds = n;
    return MP_OK;
}

int mp_ledger_join(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t ticket) {
    ledger_slot *s = live_slot(l, slot, gen);
    if (!s) return MP_EINVAL;
    uint32_t me = (uint32_t)getpid();
    ledger_holder *mine = NULL, *flight = NULL;
    for (int i = 0; i < MP_LEDGER_HOLDERS; i++) {
        ledger_holder *h = &s->holders[i];
        if (!h->count) continue;
        if (h->pid == me) mine = h;
        else if (!h->pid && h->ticket == ticket) flight = h;
    }
    int rc = MP_OK;
    if (flight && mine) {   /* the ticket's hold becomes one more of this process's */
        *flight = (ledger_holder){0, 0, 0};
        mine->count++;
    } else if (flight) {
        *flight = (ledger_holder){me, 1, 0};
    } else if (mine) {
        mine->count++;
    } else {
        ledger_holder *h = free_holder(s);
        if (h) *h = (ledger_holder){me, 1, 0};
        else rc = MP_EBUSY;
    }
    slot_unlock(s);
    return rc;
}

int mp_ledger_leave(mp_ledger *l, uint32_t slot, uint64_t gen) {
    ledger_slot *s = live_slot(l, slot, gen);
    if (!s) return MP_ENOTFOUND;
    uint32_t me = (uint32_t)getpid();
    int rc = MP_ENOTFOUND;
    for (int i = 0; i < MP_LEDGER_HOLDERS && rc != MP_OK; i++) {
        ledger_holder *h = &s->holders[i];
        if (h->count && h->pid == me) {
            if (!--h->count) *h = (ledger_holder){0, 0, 0};
            rc = MP_OK;
        }
    }
    slot_unlock(s);
    return rc;
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

int mp_ledger_attach(const char *name, mp_ledger **out) {
    if (!well_formed(name)) return MP_EINVAL;
    pthread_mutex_lock(&attached_mu);
    for (mp_ledger *l = attached; l; l = l->next) {
        if (!strcmp(l->name, name)) {
            l->refs++;
            *out = l;
            pthread_mutex_unlock(&attached_mu);
            return MP_OK;
        }
    }
    int rc = MP_EINVAL;
    mp_ledger *l = calloc(1, sizeof *l);
    int fd = l ? shm_open(name, O_RDWR, 0) : -1;
    struct stat st;
    if (!l) rc = MP_ENOMEM;
    else if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size == LEDGER_BYTES &&
             map_ledger(fd, l) == MP_OK) {
        if (__atomic_load_n(&l->head->magic, __ATOMIC_ACQUIRE) == LEDGER_MAGIC &&
            l->head->version == LEDGER_VERSION && l->head->nslots == MP_LEDGER_SLOTS) {
            rc = MP_OK;
        } else {
            munmap(l->head, LEDGER_BYTES);
        }
    }
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
        munmap(l->head, LEDGER_BYTES);
        free(l);
    }
    pthread_mutex_unlock(&attached_mu);
}
