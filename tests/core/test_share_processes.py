"""Sharing blocks with other processes (docs/sharing.md, "Other processes"): consumers
started with multiprocessing's "spawn" import a handle, read the bytes the producer wrote and
write back (host), follow the protocol (sim), die without releasing (the producer's
collect_shared drops their hold), or meet a stale handle. The consumers' code is in
tests/_share_children.py."""
import multiprocessing
import os

import numpy
import pytest

import _share_children as children
import mempool

MiB = 1 << 20
TIMEOUT = 60


@pytest.fixture(scope="module")
def spawn():
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as workers:
        yield ctx, workers


def make(backend, **options):
    options.setdefault("capacity", "256MiB")
    if backend == "host":
        options["ipc"] = True
    return mempool.Pool(backend, **options)


def ok(result):
    """The child's ("ok", ...) result; a skip when the kernel refuses pidfd_getfd."""
    if result[0] == "error" and "ptrace" in result[1]:
        pytest.skip(f"pidfd_getfd refused here: {result[1]}")
    assert result[0] == "ok", result[1]
    return result


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_host_consumer_reads_and_writes_the_producers_bytes(spawn, expandable):
    _, workers = spawn
    producer = make("host", expandable_segments=expandable)
    buf = producer.empty(3 * MiB, "uint8")
    numpy.asarray(buf)[:] = 0x11
    handle = producer.export(buf)
    _, seen, open_imports = ok(workers.apply(
        children.read_and_write, (bytes(handle), "host", 0x11, 0x22)))
    assert seen == (0x11, 3 * MiB)
    assert (numpy.asarray(buf) == 0x22).all()   # the consumer's writes, seen here
    del buf
    assert producer.collect_shared() == 1       # the consumer released: given back
    assert producer.used_bytes() == 0


def test_sim_consumer_follows_the_protocol(spawn):
    _, workers = spawn
    producer = make("sim")
    ptr = producer.alloc(MiB)
    handle = producer.export(ptr)
    producer.free(ptr)
    assert producer.collect_shared() == 0       # in flight to the consumer
    _, seen, open_imports = ok(workers.apply(
        children.read_and_write, (bytes(handle), "sim", 0, 0)))
    assert seen == (None, MiB)
    assert open_imports == 0                    # closed before the child answered
    assert producer.collect_shared() == 1
    assert producer.used_bytes() == 0


@pytest.mark.parametrize("backend", ["sim", "host"])
def test_a_consumer_killed_without_releasing_does_not_pin_forever(spawn, backend):
    ctx, _ = spawn
    producer = make(backend)
    ptr = producer.alloc(MiB)
    handle = producer.export(ptr)
    producer.free(ptr)
    here, there = ctx.Pipe()
    child = ctx.Process(target=children.hold_then_die, args=(bytes(handle), backend, there))
    child.start()
    got = here.recv() if here.poll(TIMEOUT) else None
    child.join(TIMEOUT)
    if backend == "host" and child.exitcode != -9:
        pytest.skip("the consumer could not import (pidfd_getfd refused?)")
    assert got == MiB and child.exitcode == -9
    assert producer.collect_shared() == 1       # the dead consumer's hold dropped
    assert producer.used_bytes() == 0


def test_a_stale_handle_is_refused_in_another_process(spawn):
    _, workers = spawn
    producer = make("sim")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    ok(workers.apply(children.read_and_write, (bytes(handle), "sim", 0, 0)))
    producer.free(ptr)
    assert producer.collect_shared() == 1
    answer = workers.apply(children.import_bytes, (bytes(handle), "sim"))
    assert answer.startswith("ValueError") and "stale" in answer


def test_a_closed_producers_handle_is_refused_in_another_process(spawn):
    _, workers = spawn
    producer = make("host")
    handle = producer.export(producer.alloc(4096))
    producer.close(force=True)
    answer = workers.apply(children.import_bytes, (bytes(handle), "host"))
    assert answer.startswith("ValueError") and "ledger" in answer


def test_a_forked_childs_copy_leaves_the_producers_ledger():
    import gc
    producer = make("sim")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    pid = os.fork()
    if pid == 0:                              # the child drops its copy of the pool
        del producer
        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    make("sim").import_(handle).close()       # the ledger is still there
    producer.free(ptr)
    assert producer.collect_shared() == 1


@pytest.fixture
def pidns():
    """A pid namespace of the test's own that this process takes itself for (as does the
    producer it kills): the ledger sweep of any other process, another test's, leaves that
    producer's file to the consumers here (Note [The consumers' ledger])."""
    with children.pretend_pidns() as ns:
        yield ns


@pytest.mark.parametrize("backend", ["sim", "host"])
def test_the_last_consumer_of_a_killed_producer_removes_its_ledger(spawn, backend, pidns):
    # SIGKILL leaves the producer's ledger file in /dev/shm; its consumers clean up.
    ctx, _ = spawn
    child, handle, _conn = children.killed_producer(ctx, backend, MiB, pidns)
    path = "/dev/shm" + handle.ledger
    consumer = make(backend)
    try:
        try:
            first = consumer.import_(handle)
        except RuntimeError as exc:
            pytest.skip(f"the consumer could not import: {exc}")
        second = consumer.import_(handle)
        children.kill(child)
        assert os.path.exists(path)
        first.close()
        assert os.path.exists(path)               # this process still holds the ledger
        second.close()
        assert not os.path.exists(path)
    finally:
        if child.is_alive():
            children.kill(child)
        consumer.close(force=True)


def test_a_killed_producers_handle_is_refused_naming_it_and_its_ledger_removed(spawn, pidns):
    ctx, _ = spawn
    child, handle, _conn = children.killed_producer(ctx, "sim", MiB, pidns)
    path = "/dev/shm" + handle.ledger
    children.kill(child)
    assert os.path.exists(path)
    consumer = make("sim")
    with pytest.raises(ValueError, match="producer is gone"):
        consumer.import_(handle)
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="ledger"):   # gone now, as a closed pool's is
        consumer.import_(handle)
    assert consumer.used_bytes() == 0 and consumer.device.counters().get("open_imports") == 0
