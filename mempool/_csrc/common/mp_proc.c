/* Process identity: a pid with its start time (mp_proc.h).
 *
 * Note [Process identity]
 * A process that records another by pid (the consumers' ledger: its holders, the slot
 * locks, the ledger's creator) must not take a later process for it: the kernel reuses pids
 * (after a wrap of pid_max, soon in a container's small pid space), and kill(pid, 0) answers
 * for whoever has the number now. So a process is named by its pid and its start time, field
 * 22 of /proc/<pid>/stat (clock ticks since boot: two processes of one pid never share it),
 * and it is alive while kill(pid, 0) finds a process (EPERM too: another user's is still
 * one), that process is no zombie (its memory and descriptors are gone already), and its
 * start time is the recorded one. The line is parsed from the text after its LAST ')': the
 * command name before it is the program's to choose and may hold spaces and parentheses.
 * A process reads its own start time once and keeps it beside its pid, so a fork child,
 * whose pid differs, reads its own. Where /proc does not say (not mounted, or hidepid hides
 * other users' processes) a recorded start time of 0, or an unreadable line, leaves the
 * answer to kill(pid, 0) alone: pid reuse is then not seen.
 * A pid is a number of one pid namespace, and processes of different ones may share
 * /dev/shm (containers run with a shared IPC namespace, docker's --ipc=host): there a
 * recorded pid names nothing, or another process. So a record that any process may judge
 * (the ledger's creator) carries the recorder's namespace too, the inode of
 * /proc/self/ns/pid (read once per process, with its start time; 0 where /proc does not
 * say), and only a process of that same namespace, its own known, judges the pid: to any
 * other the recorder counts as alive.
 * A pidfd would name a process exactly, but it cannot be written into shared memory for
 * other processes to test, and a pid namespace or an old kernel may lack it: the start time
 * is what any process that can see the pid can check (docs/decisions.md).
 */
#define _GNU_SOURCE
#include "mp_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mp_errors.h"

#define STAT_START_FIELD 22   /* starttime, counting pid as 1 and the command name as 2 */
#define STAT_READ_MAX 1024    /* the fields up to starttime fit, whatever the name holds */

int mp_proc_parse_stat(const char *text, size_t len, uint64_t *start, char *state) {
    if (!text || !start || !state) return MP_EINVAL;
    const char *close = NULL;
    for (size_t i = 0; i < len; i++)
        if (text[i] == ')') close = text + i;
    if (!close) return MP_EINVAL;
    const char *at = close + 1, *end = text + len;
    /* Field 3 (the state) is the first after the name; starttime is STAT_START_FIELD - 2
     * fields on. */
    for (int field = 3; field <= STAT_START_FIELD; field++) {
        if (at == end || *at != ' ') return MP_EINVAL;
        at++;
        const char *word = at;
        while (at < end && *at != ' ' && *at != '\n') at++;
        if (at == word) return MP_EINVAL;
        if (field == 3) {
            if (at - word != 1) return MP_EINVAL;
            *state = *word;
        } else if (field == STAT_START_FIELD) {
            uint64_t v = 0;
            for (const char *d = word; d < at; d++) {
                uint64_t digit = (uint64_t)(*d - '0');
                if (*d < '0' || *d > '9' || v > (UINT64_MAX - digit) / 10) return MP_EINVAL;
                v = v * 10 + digit;
            }
            *start = v;
        }
    }
    return MP_OK;
}

/* mp_proc_start, with the state letter too. */
static int read_stat(uint32_t pid, uint64_t *start, char *state) {
    if (!pid || pid > INT32_MAX) return MP_ENOTFOUND;
    int saved = errno;
    char path[32], text[STAT_READ_MAX];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int rc = MP_OK;
    int f = open(path, O_RDONLY | O_CLOEXEC);
    size_t len = 0;
    if (f < 0) {
        rc = errno == ENOENT || errno == ESRCH ? MP_ENOTFOUND : MP_EUNSUPPORTED;
    } else {
        while (len < sizeof text) {
            ssize_t n = read(f, text + len, sizeof text - len);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) rc = errno == ESRCH ? MP_ENOTFOUND : MP_EUNSUPPORTED;
            if (n <= 0) break;
            len += (size_t)n;
        }
        close(f);
    }
    if (rc == MP_OK && mp_proc_parse_stat(text, len, start, state) != MP_OK)
        rc = MP_EUNSUPPORTED;
    errno = saved;
    return rc;
}

int mp_proc_start(uint32_t pid, uint64_t *start) {
    char state;
    return start ? read_stat(pid, start, &state) : MP_EINVAL;
}

/* This process's pid, start time and pid namespace, stored pid last and read pid first, so
 * that a thread that sees its pid sees the rest; threads that race store equal values. A
 * process's pid namespace is fixed for its life (unshare and setns move only its children),
 * so a fork child, whose pid differs, reads both afresh. */
static uint32_t self_pid;
static uint64_t self_start, self_pidns;
static uint64_t pidns_as;   /* mp_proc_self_pidns_as's: 0, or the namespace pretended */

static void read_self(uint64_t *start, uint64_t *pidns) {
    uint32_t me = (uint32_t)getpid();
    if (__atomic_load_n(&self_pid, __ATOMIC_ACQUIRE) != me) {
        int saved = errno;
        uint64_t s = 0;
        struct stat st;
        if (mp_proc_start(me, &s) != MP_OK) s = 0;
        __atomic_store_n(&self_start, s, __ATOMIC_RELAXED);
        __atomic_store_n(&self_pidns, stat("/proc/self/ns/pid", &st) == 0 ?
                                      (uint64_t)st.st_ino : 0, __ATOMIC_RELAXED);
        __atomic_store_n(&self_pid, me, __ATOMIC_RELEASE);
        errno = saved;
    }
    if (start) *start = __atomic_load_n(&self_start, __ATOMIC_RELAXED);
    if (pidns) *pidns = __atomic_load_n(&self_pidns, __ATOMIC_RELAXED);
}

uint64_t mp_proc_self_start(void) {
    uint64_t s;
    read_self(&s, NULL);
    return s;
}

uint64_t mp_proc_self_pidns(void) {
    uint64_t ns = __atomic_load_n(&pidns_as, __ATOMIC_RELAXED);
    if (!ns) read_self(NULL, &ns);
    return ns;
}

void mp_proc_self_pidns_as(uint64_t ns) { __atomic_store_n(&pidns_as, ns, __ATOMIC_RELAXED); }

int mp_proc_alive(uint32_t pid, uint64_t start, unsigned bits) {
    if (!pid || pid > INT32_MAX) return 0;
    int saved = errno;
    int gone = kill((pid_t)pid, 0) != 0 && errno == ESRCH;
    errno = saved;
    if (gone) return 0;
    uint64_t mask = bits >= 64 ? UINT64_MAX : ((uint64_t)1 << bits) - 1;
    uint64_t now = 0;
    char state = 0;
    int rc = read_stat(pid, &now, &state);
    if (rc == MP_ENOTFOUND) return 0;   /* went since kill answered */
    if (rc != MP_OK) return 1;          /* /proc does not say: kill's answer stands */
    if (state == 'Z' || state == 'X') return 0;
    return !(start & mask) || (now & mask) == (start & mask);
}
