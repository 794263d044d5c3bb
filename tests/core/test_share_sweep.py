"""A producer killed before its pool closed leaves its ledger in /dev/shm (Note [The
consumers' ledger], core/mp_share_ledger.c); the next ledger made, by any process, removes
it, and removes nothing else: not a live producer's, not a file of a ledger's name that holds
no ledger of this layout, not one whose creator was recorded in another pid namespace (a pid
there names nothing here: Note [Process identity], common/mp_proc.c). Processes of "other"
namespaces are made with the test control mp_proc_self_pidns_as, which also keeps other
tests' sweeps off these tests' files; one test makes a real namespace with unshare(1) where
the kernel allows it."""
import ctypes
import multiprocessing
import os
import secrets
import select
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

import _share_children as children
import mempool

OK, ENOTFOUND = 0, 4
# The header: magic, version, slots, creator's pid, pad, its start time, its pid namespace.
HEADER = struct.Struct("<QIIIIQQ")


@pytest.fixture(scope="module")
def spawn():
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as workers:
        yield ctx, workers


@pytest.fixture(scope="module")
def lib():
    return children.ledger_library()


@pytest.fixture
def pidns():
    """A pid namespace of the test's own, which this process takes itself for."""
    with children.pretend_pidns() as ns:
        yield ns


@pytest.fixture
def template(pidns):
    """The ledger file of a live producer of this process (of namespace pidns)."""
    pool = mempool.Pool("sim", capacity="64MiB")
    handle = pool.export(pool.alloc(4096))
    yield "/dev/shm" + handle.ledger
    pool.close(force=True)


@pytest.fixture
def made():
    """Files the test makes in /dev/shm: removed after it when still there."""
    paths = []
    yield paths
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def forge(made, template, pid, start, pidns, version=None, data=None):
    """A copy of ledger file `template` (or `data`) under a new ledger name, its header naming
    creator (pid, start) of namespace `pidns` (and `version` when given): its path."""
    if data is None:
        with open(template, "rb") as f:
            data = bytearray(f.read())
        magic, ver, slots, _, pad, _, _ = HEADER.unpack_from(data)
        HEADER.pack_into(data, 0, magic, ver if version is None else version, slots, pid, pad,
                         start, pidns)
    path = f"/dev/shm/mempool-{pid}-{secrets.token_hex(8)}"
    made.append(path)
    with open(path, "wb") as f:
        f.write(data)
    return path


def sweep(workers, pidns):
    """Make a ledger in another process of namespace pidns (its sweep runs first)."""
    name = workers.apply(children.export_once, ("sim", pidns))
    assert not os.path.exists("/dev/shm" + name)   # its own went with its pool


def attach(lib, path):
    """mp_ledger_attach's code for the ledger at path (detached again when attached)."""
    ledger = ctypes.c_void_p()
    rc = lib.mp_ledger_attach(path[len("/dev/shm"):].encode(), ctypes.byref(ledger))
    if rc == OK:
        lib.mp_ledger_detach(ledger)
    return rc


def test_a_killed_producers_ledger_goes_at_the_next_ledger_made(spawn, pidns, template):
    ctx, workers = spawn
    child, handle, _conn = children.killed_producer(ctx, "sim", 4096, pidns)
    children.kill(child)
    path = "/dev/shm" + handle.ledger
    try:
        assert os.path.exists(path)                 # no consumer ever attached
        sweep(workers, pidns)
        assert not os.path.exists(path)
        assert os.path.exists(template)             # a live producer's stays
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_only_ledgers_of_this_layout_whose_creator_is_gone_go(spawn, lib, pidns, template,
                                                              made):
    _, workers = spawn
    me, start = os.getpid(), lib.mp_proc_self_start()
    with open(template, "rb") as f:
        version = HEADER.unpack_from(f.read(HEADER.size))[1]
    gone = forge(made, template, me, start + 1, pidns)   # this pid runs another process
    kept = [
        forge(made, template, me, start, pidns),           # this process: alive
        forge(made, template, me, start + 1, pidns, version=version - 1),
        forge(made, template, me, start + 1, pidns, version=version + 1),
        forge(made, None, me, 0, 0, data=b"not a ledger\n" * 4096),
        forge(made, None, me, 0, 0, data=b""),              # a ledger being made
        forge(made, None, me, 0, 0, data=open(gone, "rb").read()[:HEADER.size]),
    ]
    ill_named = f"/dev/shm/mempool-{me}-{secrets.token_hex(7)}"   # 14 hex digits
    made.append(ill_named)
    shutil.copyfile(gone, ill_named)
    sweep(workers, pidns)
    assert not os.path.exists(gone)
    assert [p for p in kept + [ill_named] if not os.path.exists(p)] == []


@pytest.mark.parametrize("recorded", ["another", "unknown"])
def test_a_creator_of_another_pid_namespace_is_not_judged(spawn, lib, pidns, template, made,
                                                          recorded):
    _, workers = spawn
    me, start = os.getpid(), lib.mp_proc_self_start()
    other = forge(made, template, me, start + 1, pidns + 1 if recorded == "another" else 0)
    control = forge(made, template, me, start + 1, pidns)
    sweep(workers, pidns)
    assert os.path.exists(other) and not os.path.exists(control)
    assert attach(lib, other) == OK                 # not refused as "producer gone"
    assert os.path.exists(other)                    # nor unlinked at the last detach
    with children.pretend_pidns(pidns + 1):         # a process of the creator's namespace
        assert attach(lib, other) == (ENOTFOUND if recorded == "another" else OK)


def test_a_killed_producer_of_another_namespace_is_left_to_its_own(spawn, lib, pidns):
    ctx, workers = spawn
    child, handle, _conn = children.killed_producer(ctx, "sim", 4096, pidns + 1)
    children.kill(child)
    path = "/dev/shm" + handle.ledger
    consumer = mempool.Pool("sim", capacity="64MiB")
    try:
        sweep(workers, pidns)
        assert os.path.exists(path)
        consumer.import_(handle).close()            # its producer is not this namespace's
        assert os.path.exists(path)
        with children.pretend_pidns(pidns + 1):
            with pytest.raises(ValueError, match="producer is gone"):
                consumer.import_(handle)
        assert not os.path.exists(path)
    finally:
        consumer.close(force=True)
        if os.path.exists(path):
            os.unlink(path)


PRODUCER = textwrap.dedent("""
    import os, sys
    import mempool
    pool = mempool.Pool("sim", capacity="64MiB")
    handle = pool.export(pool.alloc(4096))
    print(os.getpid(), bytes(handle).hex(), flush=True)
    sys.stdin.read()
    pool.close(force=True)
""")


def test_a_live_producer_in_another_pid_namespace_keeps_its_ledger(spawn):
    # A real namespace (as a container's with a shared /dev/shm): the producer is its pid 1,
    # which here is another process, of another start time.
    _, workers = spawn
    unshare = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
               "--kill-child"]
    if shutil.which("unshare") is None or \
            subprocess.run(unshare + ["true"], capture_output=True).returncode != 0:
        pytest.skip("unshare(1) cannot make a user and pid namespace here")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    producer = subprocess.Popen(unshare + [sys.executable, "-c", PRODUCER], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    path = None
    try:
        ready = select.select([producer.stdout], [], [], children.TIMEOUT)[0]
        assert ready, "the producer in its namespace did not export"
        pid, data = producer.stdout.readline().split()
        assert pid == b"1"
        handle = mempool.SharedHandle.from_bytes(bytes.fromhex(data.decode()))
        path = "/dev/shm" + handle.ledger
        sweep(workers, 0)
        assert os.path.exists(path)
        consumer = mempool.Pool("sim", capacity="64MiB")
        try:
            consumer.import_(handle).close()
        finally:
            consumer.close(force=True)
        assert os.path.exists(path)
    finally:
        producer.stdin.close()
        try:
            producer.wait(children.TIMEOUT)
        except subprocess.TimeoutExpired:
            producer.kill()
            producer.wait()
    assert producer.returncode == 0
    assert not os.path.exists(path)                 # its pool closed


def test_a_host_handle_from_another_pid_namespace_is_refused(spawn, pidns):
    # A host or cuda handle's descriptors are taken from the producer by its pid; across pid
    # namespaces that pid names another process, whose descriptor would be mapped instead.
    ctx, _ = spawn
    here, there = ctx.Pipe()
    child = ctx.Process(target=children.produce_and_wait, args=("host", 4096, there, pidns + 1))
    child.start()
    consumer = mempool.Pool("host", capacity="64MiB")
    try:
        assert here.poll(children.TIMEOUT), "the producer did not export"
        handle = mempool.SharedHandle.from_bytes(here.recv()[1])
        with pytest.raises(RuntimeError, match="another pid namespace"):
            consumer.import_(handle)
        assert consumer.stats()["allocation.all.current"] == 0
        with children.pretend_pidns(pidns + 1):     # the producer's own namespace
            try:
                consumer.import_(handle).close()
            except RuntimeError as exc:
                if "ptrace" in str(exc):
                    pytest.skip(f"pidfd_getfd refused here: {exc}")
                raise
    finally:
        consumer.close(force=True)
        here.send(None)                             # the producer ends
        child.join(children.TIMEOUT)
