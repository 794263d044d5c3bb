/* Taking a file descriptor another process of this user offers: the one owner of how a
 * consumer gets the descriptor behind a shared handle (host memfds, a cudaMemPool's export,
 * an expandable segment's physical allocations). Note [Passing descriptors] in mp_fdpass.c.
 * A piece of the common layer: it includes nothing of ours but mp_errors.h. */
#ifndef MP_FDPASS_H
#define MP_FDPASS_H

#include <stdint.h>

/* Make `fd` takeable by other processes of this user (mp_fd_take), until mp_fd_withdraw,
 * and give its secret (*secret): a random number drawn for this descriptor, which the
 * caller writes into the handle beside the descriptor's number and without which the
 * server gives it to no one; 0 where none could be drawn (the server then refuses it).
 * Offering a descriptor already offered gives the same secret. The first offer of a process
 * starts its descriptor server. MP_OK, or MP_ENOMEM when the offer could not be recorded
 * (the descriptor is then takeable only with pidfd_getfd). */
int mp_fd_offer(int fd, uint64_t *secret);

/* `fd` is no longer takeable and its secret is forgotten: call it before closing fd, so
 * that a number reused for another file is never handed out. Unknown descriptors are
 * ignored. */
void mp_fd_withdraw(int fd);

/* Descriptor `fd` of process `pid`, duplicated into this process (close-on-exec) at *out.
 * `secret` is what pid's mp_fd_offer gave for fd (from the handle's payload): its server
 * asks for it; pidfd_getfd does not.
 *   MP_OK;
 *   MP_EINVAL: the process is gone (*why_errno = ESRCH), or it has no such descriptor or does
 *     not offer it, or the server was asked with another secret than fd's (EBADF);
 *   MP_EUNSUPPORTED: neither pidfd_getfd nor the producer's server may give it: *why_errno is
 *     pidfd_getfd's refusal (EPERM or EACCES: ptrace permission; ENOSYS: the kernel lacks it),
 *     or the socket's error where pidfd_getfd was not tried (mp_fd_force_socket);
 *   MP_ENOMEM: this process is out of descriptors or memory (*why_errno says which). */
int mp_fd_take(uint32_t pid, int fd, uint64_t secret, int *out, int *why_errno);

/* Test control: with `on`, mp_fd_take asks the producer's server even where pidfd_getfd
 * would be allowed, so that the server is tested on a machine that ptrace permits. */
void mp_fd_force_socket(int on);

#endif
