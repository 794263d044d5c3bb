/* Passing file descriptors between processes of one user (mp_fdpass.h).
 *
 * Note [Passing descriptors]
 * A consumer takes the descriptor behind a shared handle in one of two ways:
 *   - pidfd_open + pidfd_getfd (Linux 5.6+): no help from the producer, but it needs ptrace
 *     permission over it, which Yama's /proc/sys/kernel/yama/ptrace_scope limits (at 1, the
 *     Ubuntu default, only an ancestor may: a worker child cannot take its parent's);
 *   - the producer's descriptor server: a detached thread of the producer, started by its
 *     first mp_fd_offer, listening on the abstract Unix socket "\0mempool-fd-<pid>"
 *     (SOCK_SEQPACKET). A request is a magic, a descriptor number and that descriptor's
 *     secret; the answer is an errno (0 for yes) and, for yes, the descriptor itself
 *     (SCM_RIGHTS).
 * pidfd_getfd is tried first; where it is refused (EPERM, EACCES) or missing (ENOSYS) the
 * server is asked. The server answers only for descriptors offered (mp_fd_offer, until
 * mp_fd_withdraw: the owner withdraws before it closes, so a number reused for another file
 * is never sent), only to a peer of its own user (SO_PEERCRED), and only to a request that
 * carries THAT descriptor's secret: a random 64-bit number drawn when the descriptor is
 * offered (getrandom, else /dev/urandom), given to the offering upstream, which writes it
 * into the handle payload beside the descriptor's number, and forgotten at withdraw. So a
 * process of the same user takes nothing from the server by guessing a descriptor's number,
 * and a holder of one handle takes only the descriptors that handle names, not every one the
 * producer offered: as Yama means only an allowed process to reach a producer's memory, a
 * handle is the permission for its own memory alone. Offering a descriptor already offered
 * gives its secret again, so every handle of one memory carries equal bytes. The secret is
 * compared in constant time and a wrong one answered as an unoffered number is (EBADF);
 * pidfd_getfd does not look at it, ptrace permission being its own proof. A descriptor for
 * which no secret could be drawn is offered to pidfd_getfd only: the server refuses it. The
 * consumer checks that the server listening on the name is the process `pid` itself
 * (SO_PEERCRED), as anyone may bind an abstract name. Offered descriptors are a table by
 * number (each entry its secret), under one lock; the server duplicates an offered one under
 * that lock and sends the duplicate, so a withdraw and close racing the answer cannot send
 * another file. Each connection is served in turn, with timeouts on both ends, so a peer that
 * never writes or reads holds the server only so long. After fork the child has no server
 * thread and offers nothing (pthread_atfork), so handles of its parent's open nothing of its:
 * its own first offer starts its own server under its own pid, with secrets of its own.
 * Abstract sockets belong to a network namespace: processes in different ones reach each
 * other only with pidfd_getfd.
 */
#define _GNU_SOURCE
#include "mp_fdpass.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "mp_errors.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

#define FD_MAGIC 0x3366706du   /* "mpf3", little-endian: requests that carry the
                                  descriptor's own secret */
#define SERVE_TIMEOUT_S 2      /* how long the server waits on one peer */
#define TAKE_TIMEOUT_S 10      /* how long a consumer waits for the server's answer */

struct fd_request {
    uint32_t magic;
    int32_t fd;
    uint64_t secret;
};

/* One descriptor number's entry: whether it is offered, and its secret. */
typedef struct fd_offer {
    uint64_t secret;
    uint8_t offered;
    uint8_t drawn;     /* a secret came: the server may give it */
} fd_offer;

static pthread_mutex_t fd_mu = PTHREAD_MUTEX_INITIALIZER;
static fd_offer *fd_offers;    /* by descriptor number */
static size_t fd_noffers;
static int fd_server = -1;     /* the listening socket, once started */
static int fd_forced;          /* mp_fd_force_socket */
static pthread_once_t fd_once = PTHREAD_ONCE_INIT;

/* ---- secrets ---- */

/* Draw a secret for entry o (getrandom, else /dev/urandom); o->drawn says whether one
 * came. */
static void fd_draw_secret(fd_offer *o) {
    int saved = errno;
    uint64_t s = 0;
    ssize_t n;
    do n = getrandom(&s, sizeof s, GRND_NONBLOCK);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof s) {   /* no getrandom, or entropy not yet ready at boot */
        n = -1;
        int f = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
        if (f >= 0) {
            do n = read(f, &s, sizeof s);
            while (n < 0 && errno == EINTR);
            close(f);
        }
    }
    o->secret = n == (ssize_t)sizeof s ? s : 0;
    o->drawn = n == (ssize_t)sizeof s;
    errno = saved;
}

/* Whether a request's secret is offered descriptor o's, in time that does not depend on
 * where they differ. Caller holds fd_mu. */
static int fd_secret_matches(const fd_offer *o, uint64_t asked) {
    uint64_t diff = asked ^ o->secret;
    unsigned acc = 0;
    for (int i = 0; i < 8; i++) acc |= (unsigned)(diff >> (8 * i)) & 0xffu;
    return o->drawn & (acc == 0);
}

/* ---- fork: the child starts with nothing offered and no server ---- */

static void fd_prepare(void) { pthread_mutex_lock(&fd_mu); }
static void fd_parent(void) { pthread_mutex_unlock(&fd_mu); }
static void fd_child(void) {
    if (fd_server >= 0) close(fd_server);   /* the parent's: the parent's thread serves it */
    fd_server = -1;
    if (fd_offers) memset(fd_offers, 0, fd_noffers * sizeof *fd_offers);
    pthread_mutex_init(&fd_mu, NULL);
}
static void fd_register_fork(void) { pthread_atfork(fd_prepare, fd_parent, fd_child); }

static socklen_t fd_address(struct sockaddr_un *a, uint32_t pid) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "mempool-fd-%u", pid);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void fd_timeouts(int s, int seconds) {
    struct timeval t = {.tv_sec = seconds};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof t);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &t, sizeof t);
}

/* The entry of offered descriptor fd, or NULL. Caller holds fd_mu. */
static fd_offer *fd_offered(int fd) {
    if (fd < 0 || (size_t)fd >= fd_noffers || !fd_offers[fd].offered) return NULL;
    return &fd_offers[fd];
}

/* ---- the server ---- */

/* Answer the requests of one connection until it ends, fails or goes quiet. */
static void fd_serve_peer(int c) {
    struct ucred cr;
    socklen_t crlen = sizeof cr;
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &crlen) != 0 || cr.uid != geteuid())
        return;   /* another user's process: no answer at all */
    fd_timeouts(c, SERVE_TIMEOUT_S);
    for (;;) {
        struct fd_request req;
        ssize_t n = recv(c, &req, sizeof req, 0);
        if (n != (ssize_t)sizeof req || req.magic != FD_MAGIC) return;
        int dup = -1;
        int32_t status = EBADF;   /* not offered, or not asked with its secret */
        pthread_mutex_lock(&fd_mu);
        const fd_offer *o = fd_offered(req.fd);
        if (o && fd_secret_matches(o, req.secret)) {
            dup = fcntl(req.fd, F_DUPFD_CLOEXEC, 0);
            status = dup >= 0 ? 0 : errno;
        }
        pthread_mutex_unlock(&fd_mu);
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } ctl;
        memset(&ctl, 0, sizeof ctl);
        struct iovec iov = {.iov_base = &status, .iov_len = sizeof status};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        if (dup >= 0) {
            m.msg_control = ctl.buf;
            m.msg_controllen = sizeof ctl.buf;
            struct cmsghdr *h = CMSG_FIRSTHDR(&m);
            h->cmsg_level = SOL_SOCKET;
            h->cmsg_type = SCM_RIGHTS;
            h->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(h), &dup, sizeof dup);
        }
        ssize_t sent = sendmsg(c, &m, MSG_NOSIGNAL);
        if (dup >= 0) close(dup);
        if (sent != (ssize_t)sizeof status) return;
    }
}

static void *fd_serve(void *arg) {
    int listener = (int)(intptr_t)arg;
    for (;;) {
        int c = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EBADF || errno == EINVAL || errno == ENOTSOCK) return NULL;
            if (errno != EINTR && errno != ECONNABORTED) {
                struct timespec pause = {.tv_nsec = 10 * 1000 * 1000};   /* out of fds */
                nanosleep(&pause, NULL);
            }
            continue;
        }
        fd_serve_peer(c);
        close(c);
    }
}

/* Start this process's server. Caller holds fd_mu. */
static int fd_start_locked(void) {
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) return MP_ENOMEM;
    struct sockaddr_un a;
    socklen_t len = fd_address(&a, (uint32_t)getpid());
    if (bind(s, (struct sockaddr *)&a, len) != 0 || listen(s, 64) != 0) {
        close(s);
        return MP_EUNSUPPORTED;
    }
    /* The thread takes no signals: they stay the application's threads' to handle. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int rc = pthread_create(&t, &attr, fd_serve, (void *)(intptr_t)s);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        close(s);
        return MP_ENOMEM;
    }
    fd_server = s;
    return MP_OK;
}

int mp_fd_offer(int fd, uint64_t *secret) {
    if (fd < 0 || !secret) return MP_EINVAL;
    pthread_once(&fd_once, fd_register_fork);
    pthread_mutex_lock(&fd_mu);
    if ((size_t)fd >= fd_noffers) {
        size_t n = fd_noffers ? fd_noffers : 64;
        while (n <= (size_t)fd) n *= 2;
        fd_offer *grown = realloc(fd_offers, n * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&fd_mu);
            return MP_ENOMEM;
        }
        memset(grown + fd_noffers, 0, (n - fd_noffers) * sizeof *grown);
        fd_offers = grown;
        fd_noffers = n;
    }
    fd_offer *o = &fd_offers[fd];
    if (!o->offered) {
        fd_draw_secret(o);
        o->offered = 1;
    }
    *secret = o->secret;
    /* A server that cannot start leaves pidfd_getfd; the next offer tries again. */
    if (fd_server < 0) (void)fd_start_locked();
    pthread_mutex_unlock(&fd_mu);
    return MP_OK;
}

void mp_fd_withdraw(int fd) {
    pthread_mutex_lock(&fd_mu);
    fd_offer *o = fd_offered(fd);
    if (o) memset(o, 0, sizeof *o);
    pthread_mutex_unlock(&fd_mu);
}

void mp_fd_force_socket(int on) { __atomic_store_n(&fd_forced, on ? 1 : 0, __ATOMIC_RELAXED); }

/* ---- the consumer ---- */

static int fd_errno_code(int e) {
    return e == EMFILE || e == ENFILE || e == ENOMEM ? MP_ENOMEM : MP_EINVAL;
}

/* Ask process pid's server for fd: an MP_ code, or -1 where no server of pid answered
 * (*why says why). */
static int fd_ask(uint32_t pid, int fd, uint64_t secret, int *out, int *why) {
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) {
        *why = errno;
        return fd_errno_code(errno) == MP_ENOMEM ? MP_ENOMEM : -1;
    }
    fd_timeouts(s, TAKE_TIMEOUT_S);
    struct sockaddr_un a;
    socklen_t len = fd_address(&a, pid);
    struct ucred cr;
    socklen_t crlen = sizeof cr;
    if (connect(s, (struct sockaddr *)&a, len) != 0) {
        *why = errno;
        close(s);
        return -1;
    }
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &crlen) != 0 || cr.pid != (pid_t)pid ||
        cr.uid != geteuid()) {
        *why = ECONNREFUSED;   /* another process listens on the name: not asked */
        close(s);
        return -1;
    }
    struct fd_request req = {.magic = FD_MAGIC, .fd = fd, .secret = secret};
    int32_t status = 0;
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = &status, .iov_len = sizeof status};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
    ssize_t n = send(s, &req, sizeof req, MSG_NOSIGNAL);
    if (n == (ssize_t)sizeof req) n = recvmsg(s, &m, MSG_CMSG_CLOEXEC);
    if (n != (ssize_t)sizeof status) {
        /* Closed unanswered (a server of another user), timed out, or not our protocol. */
        *why = n < 0 ? errno : n == 0 ? ECONNRESET : EPROTO;
        close(s);
        return -1;
    }
    close(s);
    int got = -1;
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&m); h; h = CMSG_NXTHDR(&m, h))
        if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS &&
            h->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(&got, CMSG_DATA(h), sizeof got);
    if (status == 0 && got >= 0) {
        *out = got;
        return MP_OK;
    }
    if (got >= 0) close(got);
    if (status == 0) {   /* sent, but not received: this process is out of descriptors */
        *why = (m.msg_flags & MSG_CTRUNC) ? EMFILE : EPROTO;
        return *why == EMFILE ? MP_ENOMEM : MP_EINVAL;
    }
    *why = status;
    return fd_errno_code(status);
}

int mp_fd_take(uint32_t pid, int fd, uint64_t secret, int *out, int *why_errno) {
    int ignored;
    int *why = why_errno ? why_errno : &ignored;
    *why = 0;
    if (!out || fd < 0 || !pid || pid > INT32_MAX) {
        *why = EINVAL;
        return MP_EINVAL;
    }
    int refused = 0;   /* why pidfd_getfd was not the way */
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (pidfd < 0) {
        int e = errno;
        if (e == ESRCH || (kill((pid_t)pid, 0) != 0 && errno == ESRCH)) {
            *why = ESRCH;   /* the producer is gone */
            return MP_EINVAL;
        }
        if (e != ENOSYS) {
            *why = e;   /* EINVAL: the pid names a thread, not a process */
            return fd_errno_code(e);
        }
        refused = e;
    } else if (!__atomic_load_n(&fd_forced, __ATOMIC_RELAXED)) {
        int got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
        int e = errno;
        if (got >= 0) {
            close(pidfd);
            *out = got;
            return MP_OK;
        }
        if (e != EPERM && e != EACCES && e != ENOSYS) {
            close(pidfd);
            *why = e;   /* EBADF: no such descriptor; ESRCH: gone */
            return fd_errno_code(e);
        }
        refused = e;
    }
    int asked = 0;
    int rc = fd_ask(pid, fd, secret, out, &asked);
    if (pidfd >= 0) close(pidfd);
    if (rc >= 0) {
        *why = asked;
        return rc;
    }
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) {
        *why = ESRCH;   /* went while asked */
        return MP_EINVAL;
    }
    *why = refused ? refused : asked;
    return MP_EUNSUPPORTED;
}
