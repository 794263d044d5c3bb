"""Who holds a shared block (Note [The consumers' ledger], core/mp_share_ledger.c): a process
is its pid and its start time (Note [Process identity], common/mp_proc.c), so a holder or a
slot lock recorded under a pid that now runs a process of another start time, as a reused
pid does, counts as gone. Reusing a pid for real is impractical, so the ledger's test
controls plant such a holder or lock under this process's own pid with another start time.
A ledger of another layout is refused with an error naming the version."""
import ctypes
import os
import secrets
import signal
import struct
import time

import pytest

import _share_children as children
import mempool

OK, EINVAL = 0, 3


@pytest.fixture(scope="module")
def lib():
    return children.ledger_library()


@pytest.fixture
def exported(lib):
    """A sim producer's block, exported and freed (pinned by the hold in flight), and this
    process attached to its ledger: (producer, handle, ledger pointer)."""
    producer = mempool.Pool("sim", capacity="64MiB")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    producer.free(ptr)
    ledger = ctypes.c_void_p()
    assert lib.mp_ledger_attach(handle.ledger.encode(), ctypes.byref(ledger)) == OK
    yield producer, handle, ledger
    lib.mp_ledger_detach(ledger)
    producer.close(force=True)


def stat_line(comm, state="S", start=987654321):
    fields = [state] + [str(n) for n in range(4, 22)] + [str(start)] + ["0"] * 30
    return f"4242 ({comm}) {' '.join(fields)}\n".encode()


def parse(lib, text):
    start, state = ctypes.c_uint64(0), ctypes.create_string_buffer(1)
    rc = lib.mp_proc_parse_stat(text, len(text), ctypes.byref(start), state)
    return rc, start.value, state.raw


@pytest.mark.parametrize("comm", ["python3", "a b", "x) R 1 2 3", ") (", "((", "))  ) 7"])
def test_the_start_time_is_read_after_the_last_parenthesis(lib, comm):
    assert parse(lib, stat_line(comm)) == (OK, 987654321, b"S")
    assert parse(lib, stat_line(comm, "Z", 18446744073709551615)) == \
        (OK, 18446744073709551615, b"Z")


@pytest.mark.parametrize("text", [b"", b"4242 python3 S 1 2 3", stat_line("x")[:50],
                                  stat_line("x").replace(b"987654321", b"98765x321"),
                                  stat_line("x", start=1).replace(b" 1 0 0", b" 18446744073709551616 0 0"),
                                  stat_line("x").replace(b") S", b")  S")])
def test_a_line_that_is_not_a_stat_line_is_refused(lib, text):
    assert parse(lib, text)[0] == EINVAL


def test_this_process_start_time_is_its_proc_stat_field_22(lib):
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        expected = int(f.read().rsplit(b")", 1)[1].split()[19])
    start = ctypes.c_uint64(0)
    assert lib.mp_proc_start(os.getpid(), ctypes.byref(start)) == OK
    assert start.value == expected == lib.mp_proc_self_start()


def test_a_fork_child_reads_its_own_start_time(lib):
    parent = lib.mp_proc_self_start()
    pid = os.fork()
    if pid == 0:
        start = ctypes.c_uint64(0)
        ok = lib.mp_proc_start(os.getpid(), ctypes.byref(start)) == OK
        os._exit(0 if ok and lib.mp_proc_self_start() == start.value != parent else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert lib.mp_proc_self_start() == parent


def test_a_pid_running_another_start_time_or_a_zombie_is_not_alive(lib):
    me, start = os.getpid(), lib.mp_proc_self_start()
    assert lib.mp_proc_alive(me, start, 64) == 1
    assert lib.mp_proc_alive(me, 0, 64) == 1              # unknown: the pid decides
    assert lib.mp_proc_alive(me, start + 1, 64) == 0
    assert lib.mp_proc_alive(me, start + (1 << 32), 32) == 1   # only the bits compared
    assert lib.mp_proc_alive(0, 0, 64) == 0 and lib.mp_proc_alive(1 << 31, 0, 64) == 0
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        assert lib.mp_proc_alive(pid, 0, 64) == 0         # exited, not yet reaped
    finally:
        os.waitpid(pid, 0)


def test_a_holder_whose_pid_runs_another_start_time_is_collected(lib, exported):
    producer, handle, ledger = exported
    wrong = lib.mp_proc_self_start() + 1
    assert lib.mp_ledger_join_as(ledger, handle.slot, handle.generation, handle.ticket,
                                 os.getpid(), wrong) == OK
    assert producer.collect_shared() == 1                 # its pid runs, but not that process
    assert producer.used_bytes() == 0


def test_a_live_holder_keeps_its_hold_and_a_reused_pid_cannot_give_it_back(lib, exported):
    producer, handle, ledger = exported
    me, start = os.getpid(), lib.mp_proc_self_start()
    assert lib.mp_ledger_join_as(ledger, handle.slot, handle.generation, handle.ticket,
                                 me, start + 1) == OK     # a dead process of this pid
    assert lib.mp_ledger_join(ledger, handle.slot, handle.generation, 0) == OK
    assert lib.mp_ledger_join(ledger, handle.slot, handle.generation, 0) == OK
    assert producer.collect_shared() == 0                 # this process holds it, twice
    assert lib.mp_ledger_leave(ledger, handle.slot, handle.generation) == OK
    assert producer.collect_shared() == 0
    assert lib.mp_ledger_leave(ledger, handle.slot, handle.generation) == OK
    assert lib.mp_ledger_leave(ledger, handle.slot, handle.generation) != OK   # not its own
    assert producer.collect_shared() == 1


def test_a_slot_lock_left_by_a_reused_pid_is_taken_over(lib):
    # Without the start time the lock's holder looks alive (its pid runs) and a waiter spins
    # forever; so the whole exchange runs in a fork child, killed past the deadline. The
    # child's own start time is read afresh (its pid is not its parent's).
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            producer = mempool.Pool("sim", capacity="64MiB")
            handle = producer.export(producer.alloc(4096))
            os.write(w, handle.ledger.encode())
            ledger = ctypes.c_void_p()
            assert lib.mp_ledger_attach(handle.ledger.encode(), ctypes.byref(ledger)) == OK
            me, start = os.getpid(), lib.mp_proc_self_start()
            lib.mp_ledger_lock_as(ledger, handle.slot, me, start + 1)
            code = lib.mp_ledger_join(ledger, handle.slot, handle.generation, handle.ticket)
            if code == OK:   # the lock was taken over and given back; the hold is this one's
                assert lib.mp_ledger_leave(ledger, handle.slot, handle.generation) == OK
        finally:
            os._exit(code)
    os.close(w)
    name = os.read(r, 200).decode()
    os.close(r)
    deadline, status = time.monotonic() + 30, None
    while status is None and time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = os.waitstatus_to_exitcode(code) if done else None
        time.sleep(0.01)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if name and os.path.exists("/dev/shm" + name):
        os.unlink("/dev/shm" + name)              # the child exited without closing its pool
    assert status == 0, "the waiter did not take the lock over"


@pytest.mark.parametrize("kind", ["version", "size"])
def test_a_ledger_of_another_version_is_refused_naming_it(kind):
    producer = mempool.Pool("sim", capacity="64MiB")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    name = handle.ledger
    fake = name[:-16] + secrets.token_hex(8)
    with open("/dev/shm" + name, "rb") as f:   # this version's: the file of one too short
        version = struct.unpack_from("<I", f.read(12), 8)[0]
    header = struct.pack("<QIIII", 0x52454744454C504D,
                         version - 1 if kind == "version" else version, 2048, os.getpid(), 0)
    path = "/dev/shm" + fake
    with open(path, "wb") as f:
        f.write(header + bytes(4096))
    try:
        data = bytes(handle).replace(name.encode(), fake.encode())
        with pytest.raises(ValueError, match="another version of mempool"):
            mempool.Pool("sim", capacity="64MiB").import_(mempool.SharedHandle.from_bytes(data))
    finally:
        os.unlink(path)
        producer.free(ptr)
        producer.close(force=True)
