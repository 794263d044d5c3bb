"""What the consumer and producer processes of tests/core/test_share_*.py run (started with
multiprocessing's "spawn": a function of an importable module, beside _support.py), and the
helpers that start them or reach the ledger's C symbols."""
import contextlib
import os
import signal

import mempool


def read_and_write(handle_bytes, backend, value, answer):
    """Import the handle, check every byte is `value`, write `answer` over them, release;
    returns what it saw (first byte, length) or the error."""
    import numpy
    handle = mempool.SharedHandle.from_bytes(handle_bytes)
    pool = mempool.Pool(backend, capacity="64MiB")
    try:
        with pool.import_(handle) as buf:
            view = numpy.asarray(buf) if backend == "host" else None
            seen = (int(view[0]), int((view == value).sum())) if view is not None else \
                (None, buf.nbytes)
            if view is not None:
                view[:] = answer
                del view
        return ("ok", seen, pool.device.counters().get("open_imports"))
    except Exception as exc:   # reported to the parent, which asserts on it
        return ("error", f"{type(exc).__name__}: {exc}", None)
    finally:
        pool.close(force=True)


def hold_then_die(handle_bytes, backend, ready):
    """Import the handle, tell the parent, and die by SIGKILL without releasing."""
    handle = mempool.SharedHandle.from_bytes(handle_bytes)
    pool = mempool.Pool(backend, capacity="64MiB")
    buf = pool.import_(handle)
    ready.send(buf.nbytes)   # a pipe: sent before the call returns, unlike a Queue's thread
    os.kill(os.getpid(), signal.SIGKILL)


def import_bytes(handle_bytes, backend):
    """Import in a child: the error's type and message, or "ok"."""
    pool = mempool.Pool(backend, capacity="64MiB")
    try:
        pool.import_(mempool.SharedHandle.from_bytes(handle_bytes)).close()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        pool.close(force=True)


def core_library():
    """The compiled core's C symbols (Note [Passing descriptors] in common/mp_fdpass.c)."""
    import ctypes
    from mempool import _core
    lib = ctypes.CDLL(_core.__file__)
    lib.mp_fd_take.argtypes = [ctypes.c_uint32, ctypes.c_int, ctypes.c_uint64,
                               ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.mp_fd_force_socket.argtypes = [ctypes.c_int]
    lib.mp_fd_offer.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    lib.mp_fd_withdraw.argtypes = [ctypes.c_int]
    return lib


def take(pid, fd, secret, force_socket=True):
    """mp_fd_take in this process, asking with `secret`: (code, errno, the inode of what came
    or None)."""
    import ctypes
    lib = core_library()
    lib.mp_fd_force_socket(1 if force_socket else 0)
    out, why = ctypes.c_int(-1), ctypes.c_int(0)
    rc = lib.mp_fd_take(pid, fd, secret, ctypes.byref(out), ctypes.byref(why))
    lib.mp_fd_force_socket(0)
    inode = None
    if rc == 0:
        inode = os.fstat(out.value).st_ino
        os.close(out.value)
    return rc, why.value, inode


def read_and_write_by_socket(handle_bytes, backend, value, answer):
    """read_and_write, taking the descriptors from the producer's server only."""
    core_library().mp_fd_force_socket(1)
    try:
        return read_and_write(handle_bytes, backend, value, answer)
    finally:
        core_library().mp_fd_force_socket(0)


def drop_ptrace_capability():
    """Leave CAP_SYS_PTRACE out of this process's effective set (a no-op unprivileged), so
    that ptrace permission over a non-dumpable process is refused as Yama refuses it."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)   # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()                  # {effective, permitted, inheritable} x 2
    assert libc.capget(header, data) == 0, ctypes.get_errno()
    data[0] &= ~(1 << 19)                           # CAP_SYS_PTRACE
    assert libc.capset(header, data) == 0, ctypes.get_errno()


def pidfd_getfd_refused(pid, fd):
    """Whether pidfd_getfd of `fd` of `pid` is refused for permission here."""
    import ctypes
    import errno
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(434, pid, 0)               # pidfd_open: one number on every arch
    if pidfd < 0:
        return False
    got = libc.syscall(438, pidfd, fd, 0)           # pidfd_getfd
    err = ctypes.get_errno()
    os.close(pidfd)
    if got >= 0:
        os.close(got)
    return got < 0 and err in (errno.EPERM, errno.EACCES)


def produce_undumpable(backend, value, nbytes, conn):
    """A producer no process may ptrace (PR_SET_DUMPABLE 0, as Yama refuses a child its
    parent): export a block of `value` bytes, send (pid, handle bytes, the first memfd's
    number), wait for the word to look, send what the block holds then, and exit."""
    import ctypes
    import numpy
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)         # PR_SET_DUMPABLE, 0
    pool = mempool.Pool(backend, capacity="64MiB", ipc=True)
    buf = pool.empty(nbytes, "uint8")
    numpy.asarray(buf)[:] = value
    handle = pool.export(buf)
    conn.send((os.getpid(), bytes(handle)))
    conn.recv()
    view = numpy.asarray(buf)
    conn.send((int(view[0]), int((view == view[0]).sum())))
    del view
    conn.recv()


def consume_without_ptrace(handle_bytes, backend, value, answer, pid, conn):
    """Without ptrace permission over producer `pid`: send whether pidfd_getfd was refused
    here (so the descriptors can come only from the producer's server) and read_and_write's
    answer."""
    drop_ptrace_capability()
    any_fd = 0   # permission is checked before the descriptor is looked up
    conn.send((pidfd_getfd_refused(pid, any_fd), read_and_write(handle_bytes, backend, value,
                                                                answer)))


def offer(fd):
    """mp_fd_offer(fd) in this process: the descriptor's secret."""
    import ctypes
    secret = ctypes.c_uint64(0)
    assert core_library().mp_fd_offer(fd, ctypes.byref(secret)) == 0
    return secret.value


def offer_and_wait(conn):
    """A process that offers two memfds and says (pid, fd, inode, a fd it did not offer, the
    first one's secret, (the second one, its inode, its secret))."""
    fd = os.memfd_create("mempool-test")
    second = os.memfd_create("mempool-test-second")
    other = os.memfd_create("mempool-test-unoffered")
    secret, second_secret = offer(fd), offer(second)
    conn.send((os.getpid(), fd, os.fstat(fd).st_ino, other, secret,
               (second, os.fstat(second).st_ino, second_secret)))
    conn.recv()


def ledger_library():
    """core_library with the ledger's and process identity's symbols (Note [The consumers'
    ledger] in core/mp_share_ledger.c, Note [Process identity] in common/mp_proc.c)."""
    import ctypes
    lib = core_library()
    lib.mp_ledger_attach.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.mp_ledger_detach.argtypes = [ctypes.c_void_p]
    lib.mp_ledger_join.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                   ctypes.c_uint64]
    lib.mp_ledger_join_as.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64,
                                      ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64]
    lib.mp_ledger_leave.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64]
    lib.mp_ledger_lock_as.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32,
                                      ctypes.c_uint64]
    lib.mp_ledger_lock_as.restype = None
    lib.mp_proc_start.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64)]
    lib.mp_proc_self_start.argtypes = []
    lib.mp_proc_self_start.restype = ctypes.c_uint64
    lib.mp_proc_alive.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint]
    lib.mp_proc_parse_stat.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p]
    lib.mp_proc_self_pidns.argtypes = []
    lib.mp_proc_self_pidns.restype = ctypes.c_uint64
    lib.mp_proc_self_pidns_as.argtypes = [ctypes.c_uint64]
    lib.mp_proc_self_pidns_as.restype = None
    return lib


def fake_pidns():
    """A pid namespace no process has (real ones are 32-bit inodes), for processes that take
    themselves for one with mp_proc_self_pidns_as: only processes that pretend the same judge
    its ledgers' creators, so no other test's ledger sweep removes them meanwhile."""
    import secrets
    return (1 << 40) + secrets.randbits(32)


@contextlib.contextmanager
def pretend_pidns(ns=None):
    """This process takes itself for one of pid namespace `ns` (a fake_pidns() when None)
    for the block; yields the namespace."""
    lib = ledger_library()
    ns = fake_pidns() if ns is None else ns
    lib.mp_proc_self_pidns_as(ns)
    try:
        yield ns
    finally:
        lib.mp_proc_self_pidns_as(0)


def export_once(backend, pidns=0):
    """Make a pool that exports one block (making its ledger, which first sweeps /dev/shm),
    as a process of pid namespace `pidns` (0: its own); returns the ledger's name."""
    lib = ledger_library()
    lib.mp_proc_self_pidns_as(pidns)
    pool = mempool.Pool(backend, capacity="64MiB", ipc=(backend == "host") or None)
    try:
        return pool.export(pool.alloc(4096)).ledger
    finally:
        pool.close(force=True)
        lib.mp_proc_self_pidns_as(0)


def produce_and_wait(backend, nbytes, conn, pidns=0):
    """A producer that exports a block and sends (pid, handle bytes), then waits to be
    killed; as a process of pid namespace `pidns` when it is not 0."""
    if pidns:
        ledger_library().mp_proc_self_pidns_as(pidns)
    pool = mempool.Pool(backend, capacity="64MiB", ipc=(backend == "host") or None)
    buf = pool.empty(nbytes, "uint8")
    handle = pool.export(buf)
    conn.send((os.getpid(), bytes(handle)))
    conn.recv()


TIMEOUT = 60


def killed_producer(ctx, backend, nbytes, pidns=0):
    """A spawned produce_and_wait, of pid namespace `pidns` (0: its own), that exported a
    block of nbytes: (process, handle, connection). The caller keeps the connection: closing
    it ends the producer, which then closes its pool."""
    here, there = ctx.Pipe()
    child = ctx.Process(target=produce_and_wait, args=(backend, nbytes, there, pidns))
    child.start()
    assert here.poll(TIMEOUT), "the producer did not export"
    _, data = here.recv()
    return child, mempool.SharedHandle.from_bytes(data), here


def kill(child):
    """SIGKILL a spawned process and reap it."""
    child.kill()
    child.join(TIMEOUT)
    assert child.exitcode == -9
