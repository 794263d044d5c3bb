/* Which process a pid names: a pid with its start time, so that a pid the kernel hands to a
 * new process after the old one died is not taken for the old one. Note [Process identity]
 * in mp_proc.c. A piece of the common layer: it includes nothing of ours but mp_errors.h. */
#ifndef MP_PROC_H
#define MP_PROC_H

#include <stddef.h>
#include <stdint.h>

/* The start time of process `pid` (field 22 of /proc/<pid>/stat: clock ticks since boot).
 *   MP_OK;
 *   MP_ENOTFOUND: no such process (it is gone);
 *   MP_EUNSUPPORTED: /proc does not say (not mounted, hidden, or a line not parsed). */
int mp_proc_start(uint32_t pid, uint64_t *start);

/* This process's start time, read once per process (a fork child reads its own); 0 where
 * /proc does not say. */
uint64_t mp_proc_self_start(void);

/* This process's pid namespace: the inode of /proc/self/ns/pid, read once per process (a
 * fork child reads its own); 0 where /proc does not say. Pids recorded by a process of
 * another namespace are not this one's to judge (Note [Process identity]). */
uint64_t mp_proc_self_pidns(void);

/* Test control: this process takes itself for one of pid namespace `ns` (a fork child
 * too), so that tests can make processes of "other" namespaces; 0 reads its own again. */
void mp_proc_self_pidns_as(uint64_t ns);

/* Whether process (pid, start) still runs: kill(pid, 0) finds a process (or is refused
 * with EPERM), it is no zombie, and its start time is `start`. Only the low `bits` bits of
 * the start times are compared (a caller that stores fewer keeps the low ones); a start of 0
 * in those bits is unknown and the pid alone decides, as it does where /proc does not say.
 * pid 0, or one past INT32_MAX, is no process. */
int mp_proc_alive(uint32_t pid, uint64_t start, unsigned bits);

/* Parse a /proc/<pid>/stat line of `len` bytes: its start time and state letter. MP_EINVAL
 * for a line that is not one. (Exposed so that tests can give it hostile command names.) */
int mp_proc_parse_stat(const char *text, size_t len, uint64_t *start, char *state);

#endif
