"""Taking another process's descriptors (Note [Passing descriptors], common/mp_fdpass.c):
pidfd_getfd where ptrace permission allows, else the producer's descriptor server, which
answers only a request carrying the asked descriptor's own secret (written into the handle
beside it). This
machine allows pidfd_getfd, so the server is reached by forcing it (mp_fd_force_socket) or by
making ptrace permission refused for real: a non-dumpable producer and a consumer without
CAP_SYS_PTRACE, which is how Yama's ptrace_scope=1 treats a child taking its parent's
descriptors. The processes' code is in tests/_share_children.py."""
import errno
import multiprocessing
import os
import socket

import numpy
import pytest

import _share_children as children
import mempool

MiB = 1 << 20
TIMEOUT = 60
OK, EINVAL, EUNSUPPORTED = 0, 3, 9
HOST_ENTRY = 36   # bytes of one memfd's entry in a host payload


@pytest.fixture(scope="module")
def ctx():
    return multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def workers(ctx):
    with ctx.Pool(1) as pool:
        yield pool


@pytest.fixture
def offering(ctx):
    """A spawned process offering two memfds: (pid, fd, its inode, a fd it did not offer, its
    secret, (the second fd, its inode, its secret))."""
    here, there = ctx.Pipe()
    child = ctx.Process(target=children.offer_and_wait, args=(there,))
    child.start()
    assert here.poll(TIMEOUT)
    yield here.recv()
    here.send("done")
    child.join(TIMEOUT)


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_host_bytes_cross_both_ways_through_the_producers_server(workers, expandable):
    producer = mempool.Pool("host", capacity="256MiB", ipc=True, expandable_segments=expandable)
    buf = producer.empty(3 * MiB, "uint8")
    numpy.asarray(buf)[:] = 0x31
    handle = producer.export(buf)
    result = workers.apply(children.read_and_write_by_socket,
                           (bytes(handle), "host", 0x31, 0x42))
    assert result[0] == "ok", result[1]
    assert result[1] == (0x31, 3 * MiB)
    assert (numpy.asarray(buf) == 0x42).all()    # the consumer's writes, seen here
    del buf
    assert producer.collect_shared() == 1
    producer.close()


def test_a_host_handle_with_another_secret_is_refused_by_the_server(workers):
    # The payload carries the memfd's secret; with one bit of it flipped the server gives
    # nothing, while pidfd_getfd, where ptrace allows, ignores it.
    producer = mempool.Pool("host", capacity="64MiB", ipc=True)
    buf = producer.empty(MiB, "uint8")
    numpy.asarray(buf)[:] = 0x17
    data = bytes(producer.export(buf))
    at = host_secret_at(data)
    hostile = data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
    result = workers.apply(children.read_and_write_by_socket, (hostile, "host", 0x17, 0x18))
    assert result[0] == "error" and result[1].startswith("ValueError"), result
    result = workers.apply(children.read_and_write_by_socket, (data, "host", 0x17, 0x18))
    assert result[0] == "ok", result[1]
    result = workers.apply(children.read_and_write, (hostile, "host", 0x18, 0x19))
    if workers.apply(children.pidfd_getfd_refused, (os.getpid(), 0)):
        assert result[0] == "error" and result[1].startswith("ValueError"), result
    else:
        assert result[0] == "ok", result[1]
    del buf
    producer.close(force=True)


def host_secret_at(data):
    """Where a one-memfd host handle holds its memfd's secret: the payload ends the handle,
    and its one entry (u32 fd, u64 secret, u64 inode, u64 bytes, u64 serial) ends the
    payload (Note [Host sharing], upstream/mp_host.c)."""
    return len(data) - HOST_ENTRY + 4


def test_a_host_handle_carrying_another_handles_secret_is_refused_by_the_server(workers):
    nbytes = 24 * MiB
    # Two blocks in two segments (large requests get a segment each): two memfds, each with
    # its own secret. Handle B with A's secret in place of its own asks for B's memfd with
    # A's secret: the server refuses it, as a holder of A must not open B; B's own bytes open.
    producer = mempool.Pool("host", capacity="256MiB", ipc=True)
    a, b = producer.empty(nbytes, "uint8"), producer.empty(nbytes, "uint8")
    assert producer.export(a).region != producer.export(b).region
    numpy.asarray(a)[:] = 0x21
    numpy.asarray(b)[:] = 0x22
    handle_a, handle_b = bytes(producer.export(a)), bytes(producer.export(b))
    at_a, at_b = host_secret_at(handle_a), host_secret_at(handle_b)
    secret_a, secret_b = handle_a[at_a:at_a + 8], handle_b[at_b:at_b + 8]
    assert secret_a != secret_b
    hostile = handle_b[:at_b] + secret_a + handle_b[at_b + 8:]
    result = workers.apply(children.read_and_write_by_socket, (hostile, "host", 0x22, 0x23))
    assert result[0] == "error" and result[1].startswith("ValueError"), result
    assert (numpy.asarray(b) == 0x22).all()
    result = workers.apply(children.read_and_write_by_socket, (handle_b, "host", 0x22, 0x23))
    assert result[0] == "ok" and result[1] == (0x22, nbytes), result
    result = workers.apply(children.read_and_write_by_socket, (handle_a, "host", 0x21, 0x24))
    assert result[0] == "ok" and result[1] == (0x21, nbytes), result
    del a, b
    producer.close(force=True)


def test_a_consumer_refused_ptrace_takes_the_descriptors_from_the_server(ctx):
    # The producer is not dumpable and the consumer lacks CAP_SYS_PTRACE: pidfd_getfd is
    # refused (checked in the consumer), so the bytes can cross only through the server.
    here, there = ctx.Pipe()
    producer = ctx.Process(target=children.produce_undumpable, args=("host", 0x5A, 2 * MiB, there))
    producer.start()
    try:
        assert here.poll(TIMEOUT)
        pid, data = here.recv()
        back, forth = ctx.Pipe()
        consumer = ctx.Process(target=children.consume_without_ptrace,
                               args=(data, "host", 0x5A, 0x6B, pid, forth))
        consumer.start()
        assert back.poll(TIMEOUT)
        refused, result = back.recv()
        consumer.join(TIMEOUT)
        assert refused, "pidfd_getfd was allowed: the test reached no server"
        assert result[0] == "ok", result[1]
        assert result[1] == (0x5A, 2 * MiB)
        here.send("look")
        assert here.poll(TIMEOUT)
        assert here.recv() == (0x6B, 2 * MiB)      # the consumer's writes, in the producer
    finally:
        here.send("exit")
        producer.join(TIMEOUT)


def test_the_server_gives_only_what_was_offered(workers, offering):
    pid, fd, inode, other, secret, _ = offering
    assert workers.apply(children.take, (pid, fd, secret)) == (OK, 0, inode)
    assert workers.apply(children.take, (pid, other, secret)) == (EINVAL, errno.EBADF, None)
    assert workers.apply(children.take, (pid, 4096, secret)) == (EINVAL, errno.EBADF, None)
    # pidfd_getfd, where ptrace allows, takes any descriptor: the server is what refuses
    rc, why, _ = workers.apply(children.take, (pid, other, secret, False))
    assert rc == OK or why in (errno.EPERM, errno.EACCES)


def test_the_server_gives_nothing_without_the_descriptors_secret(workers, offering):
    # Knowing an offered descriptor's number is not enough: a request must carry the secret
    # the handle holds beside it, and a wrong one is refused as an unoffered number is.
    pid, fd, inode, _, secret, _ = offering
    for wrong in (secret ^ 1, secret ^ (1 << 63), 0, (1 << 64) - 1):
        if wrong != secret:
            assert workers.apply(children.take, (pid, fd, wrong)) == (EINVAL, errno.EBADF, None)
    assert workers.apply(children.take, (pid, fd, secret)) == (OK, 0, inode)
    # pidfd_getfd needs ptrace permission instead, and does not look at the secret
    rc, why, got = workers.apply(children.take, (pid, fd, secret ^ 1, False))
    assert (rc, got) == (OK, inode) or why in (errno.EPERM, errno.EACCES)


def test_one_descriptors_secret_takes_no_other(workers, offering):
    # Each offered descriptor has a secret of its own: a holder of one handle (one secret)
    # cannot ask the server for another descriptor the producer offered.
    pid, fd, inode, _, secret, (second, second_inode, second_secret) = offering
    assert secret != second_secret
    assert workers.apply(children.take, (pid, second, secret)) == (EINVAL, errno.EBADF, None)
    assert workers.apply(children.take, (pid, fd, second_secret)) == (EINVAL, errno.EBADF, None)
    assert workers.apply(children.take, (pid, second, second_secret)) == (OK, 0, second_inode)
    assert workers.apply(children.take, (pid, fd, secret)) == (OK, 0, inode)


def test_offering_again_gives_the_same_secret_and_a_withdrawn_number_a_new_one():
    lib = children.core_library()
    fd = os.memfd_create("mempool-test-again")
    try:
        first = children.offer(fd)
        assert children.offer(fd) == first        # equal handle bytes for one memory
        lib.mp_fd_withdraw(fd)
        assert children.offer(fd) != first        # the number may name another file now
    finally:
        lib.mp_fd_withdraw(fd)
        os.close(fd)


def test_a_producer_that_exited_is_named_gone(ctx, workers):
    child = ctx.Process(target=children.offer_and_wait, args=(ctx.Pipe()[1],))
    child.start()
    pid = child.pid
    child.kill()
    child.join(TIMEOUT)
    for force in (True, False):
        assert workers.apply(children.take, (pid, 3, 0, force)) == (EINVAL, errno.ESRCH, None)


def test_an_impostor_on_the_producers_name_is_not_asked(offering):
    # A process of this user listening on another process's name: the consumer checks the
    # listener's pid and asks nothing (here the producer has its own server under its pid,
    # so the impostor takes the name of a process that has none: this one's parent).
    pid, fd, _, _, secret, _ = offering
    victim = os.getppid()
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        impostor.bind(f"\0mempool-fd-{victim}")
    except OSError:
        impostor.close()
        pytest.skip("the name is taken: the parent process offers descriptors itself")
    impostor.listen(4)
    try:
        rc, why, _ = children.take(victim, fd, secret)
        assert (rc, why) == (EUNSUPPORTED, errno.ECONNREFUSED)
    finally:
        impostor.close()


def test_a_forked_child_offers_nothing_of_its_parents(offering):
    # This process offers a memfd; its fork child offers one of its own under its own pid,
    # and never the parent's (which it holds a copy of), even asked with the parent's secret.
    lib = children.core_library()
    mine = os.memfd_create("mempool-test-parent")
    secret = children.offer(mine)
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(go_w)
        theirs = os.memfd_create("mempool-test-child")
        code, child_secret = 0, children.offer(theirs)
        os.write(w, f"{code} {theirs} {os.fstat(theirs).st_ino} {child_secret}".encode())
        os.read(go_r, 1)
        os._exit(0)
    os.close(w)
    os.close(go_r)
    try:
        code, theirs, inode, child_secret = (int(x) for x in os.read(r, 200).split())
        assert code == 0
        assert child_secret != secret
        assert children.take(pid, theirs, child_secret) == (OK, 0, inode)
        assert children.take(pid, theirs, secret) == (EINVAL, errno.EBADF, None)
        assert children.take(pid, mine, child_secret) == (EINVAL, errno.EBADF, None)
        assert children.take(pid, mine, secret) == (EINVAL, errno.EBADF, None)
        assert children.take(os.getpid(), mine, secret)[0] == OK   # still the parent's own
        assert children.offer(mine) == secret
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        lib.mp_fd_withdraw(mine)
        os.close(mine)
