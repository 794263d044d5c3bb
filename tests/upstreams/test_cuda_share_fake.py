"""Sharing the CUDA upstream's memory with other processes (mempool/_csrc/upstream/
mp_cuda_share.c, Note [Sharing CUDA memory]) on the stand-in driver (tests/data/fake_libcuda.c).

The producer is a forked child of the test's interpreter, so the consumer really takes the
producer's descriptors with pidfd_getfd; the fake's exports are memfds holding what they name,
so an import of anything else is refused. What the real driver does is the GPU tier's
(tests/gpu/test_gpu_ipc.py, tests/gpu/test_gpu_torch_ipc.py).
"""
import textwrap

from _fake_cuda import G, run_fake

# In the harness: run `make` in a forked child (the producer), whose returned dict comes back
# as JSON (bytes as hex); the child stays alive, holding its memory, until `release()`.
PRODUCER = """
import json, os

def produce(make):
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r1); os.close(w2)
        try:
            out = make()
        except BaseException as exc:
            out = {"error": repr(exc)}
        os.write(w1, (json.dumps(out) + "\\n").encode())
        os.read(r2, 1)
        os._exit(0)
    os.close(w1); os.close(r2)
    line = b""
    while not line.endswith(b"\\n"):
        line += os.read(r1, 65536)
    out = json.loads(line)
    assert "error" not in out, out["error"]

    def release():
        os.write(w2, b"x")
        assert os.waitpid(pid, 0)[1] == 0
    return pid, out, release
"""


# A producer that shares one segment and one run of two pages; the consumer's script goes on
# with their handles in out["seg"] and out["pages"].
SEGMENT_AND_PAGES = textwrap.indent(textwrap.dedent("""
    def make():
        c = Cuda(0, shareable_pool=True)
        c.set_shareable(1)
        seg = c.segment(1 << 20)
        va = c.reserve(4 * g)
        c.map(va, 2 * g)
        return {"seg": c.share(seg, 1 << 20)[1].hex(), "pages": c.share(va, 2 * g, 1)[1].hex()}

    pid, out, release = produce(make)"""), " " * 8).lstrip()


def run(fake_driver, body, **env):
    run_fake(fake_driver, PRODUCER + textwrap.dedent(body), **env)


def test_a_segment_opens_in_another_process_through_the_pool_import(fake_driver):
    run(fake_driver, """
        def make():
            c = Cuda(0, shareable_pool=True)
            assert c.set_shareable(1) == (OK, "")
            a, b = c.segment(4 << 20), c.segment(1 << 20)
            rc, one = c.share(a, 4 << 20)
            assert rc == OK, one
            assert c.share(a, 4 << 20) == (OK, one)          # equal bytes for one segment
            rc, two = c.share(b, 1 << 20)
            assert rc == OK and two != one
            # the pool is exported once; each segment's pointer each time
            assert fake.fake_share_count(0) == 1 and fake.fake_share_count(1) == 3
            return {"one": one.hex(), "two": two.hex()}

        pid, out, release = produce(make)
        one, two = bytes.fromhex(out["one"]), bytes.fromhex(out["two"])
        c = Cuda(1)                                   # a consumer on another device
        rc, base = c.open(one, 4 << 20)
        assert rc == OK, base
        assert fake.fake_share_count(2) == 1 and fake.fake_share_count(3) == 1
        assert c.open(one, 4 << 20) == (OK, base)     # one mapping per process, counted
        assert fake.fake_share_count(3) == 1
        rc, other = c.open(two, 1 << 20)
        assert rc == OK and other != base
        assert fake.fake_share_count(2) == 1          # the producer's pool imported once
        assert fake.fake_live_imported_pointers() == 2
        assert c.close(base, 4 << 20) == OK
        assert fake.fake_live_imported_pointers() == 2   # still opened once
        assert c.close(base, 4 << 20) == OK
        assert fake.fake_live_imported_pointers() == 1
        assert fake.fake_live_imported_pools() == 1
        assert c.close(other, 1 << 20) == OK          # the last pointer: the pool import goes
        assert fake.fake_live_imported_pointers() == 0
        assert fake.fake_live_imported_pools() == 0 and fake.fake_share_count(7) == 1
        assert c.close(other, 1 << 20) == EINVAL      # not open any more
        rc, again = c.open(one, 4 << 20)              # opens afresh
        assert rc == OK and fake.fake_share_count(2) == 2
        assert c.close(again, 4 << 20) == OK
        release()
        c.destroy()
    """)


def test_expandable_pages_open_mapped_end_to_end(fake_driver):
    run(fake_driver, f"""
        g = {G}
        def make():
            c = Cuda(0)
            assert c.set_shareable(1) == (OK, "")
            va = c.reserve(8 * g)
            assert c.map(va, 2 * g) == OK and c.map(va + 2 * g, g) == OK
            rc, data = c.share(va, 3 * g, 1)
            assert rc == OK, data
            assert fake.fake_share_count(4) == 2          # one export per allocation
            assert c.share(va, 3 * g, 1) == (OK, data)
            assert fake.fake_share_count(4) == 2          # kept while mapped
            assert c.share(va + g, 2 * g, 1)[0] == EINVAL   # part of an allocation
            assert c.share(va, 4 * g, 1)[0] == EINVAL       # runs past the mapped pages
            # the descriptors stay open while mapped and close at unmap
            fds = [int.from_bytes(data[40 + 32 * i:44 + 32 * i], "little") for i in range(2)]
            for fd in fds:
                os.fstat(fd)
            assert c.unmap(va + 2 * g, g) == OK
            try:
                os.fstat(fds[1])
                raise AssertionError("the descriptor outlived its allocation")
            except OSError:
                pass
            assert c.map(va + 2 * g, g) == OK
            rc, again = c.share(va, 3 * g, 1)
            assert rc == OK and again != data              # a new allocation, other bytes
            return {{"data": again.hex()}}

        pid, out, release = produce(make)
        data = bytes.fromhex(out["data"])
        c = Cuda(0)
        assert fake.fake_mapped_pages() == 0
        rc, base = c.open(data, 3 * g)
        assert rc == OK, base
        assert fake.fake_share_count(5) == 2              # each allocation imported
        assert c.pages(base, 3) == [1, 1, 1]               # mapped, device 0 granted
        assert fake.fake_live_handles() == 0               # the mappings hold the memory
        assert c.open(data, 2 * g)[0] == EINVAL            # sizes that do not add up
        assert c.close(base, 3 * g) == OK
        assert fake.fake_mapped_pages() == 0
        release()
        c.destroy()
    """)


def test_unshareable_memory_is_refused_saying_how_to_share(fake_driver):
    run(fake_driver, """
        c = Cuda(0)                                    # a pool without the handle type
        seg = c.segment(1 << 20)
        rc, msg = c.share(seg, 1 << 20)
        assert rc == EUNSUPPORTED and "ipc=True" in msg, msg     # not made shareable
        assert c.set_shareable(1) == (OK, "")
        rc, msg = c.share(seg, 1 << 20)
        assert rc == EUNSUPPORTED, msg
        assert 'pool_handle="create"' in msg and "cuMemPoolExportToShareableHandle" in msg, msg
        assert fake.fake_share_count(1) == 0
        va = c.reserve(4 * c.g)
        assert c.set_shareable(0)[0] == EBUSY          # said before any reservation only
        c.destroy()
    """)


def test_pages_the_driver_will_not_make_exportable_are_made_and_refused(fake_driver):
    run(fake_driver, """
        c = Cuda(0)
        assert c.set_shareable(1) == (OK, "")
        va = c.reserve(4 * c.g)
        assert c.map(va, c.g) == OK                    # made without the handle type
        rc, msg = c.share(va, c.g, 1)
        assert rc == EUNSUPPORTED and "CUDA_ERROR_NOT_SUPPORTED" in msg, msg
        c.destroy()
    """, FAKE_NO_SHARE_PAGES="1")


def test_bytes_no_share_made_are_refused_and_nothing_is_imported(fake_driver):
    run(fake_driver, f"""
        g = {G}
        {SEGMENT_AND_PAGES}
        seg, pages = bytes.fromhex(out["seg"]), bytes.fromhex(out["pages"])
        c = Cuda(0)
        bad = [b"", b"x", bytes(104), seg[:-1], seg + b"\\0", bytes([9]) + seg[1:],
               seg[:1] + bytes([7]) + seg[2:], seg[:4] + bytes(4) + seg[8:],
               pages[:24] + (0).to_bytes(4, "little") + pages[28:],
               pages[:24] + (5).to_bytes(4, "little") + pages[28:],
               pages[:48] + (3).to_bytes(8, "little") + pages[56:],
               pages[:40] + (2**32 - 1).to_bytes(4, "little") + pages[44:],
               pages[:32] + (1).to_bytes(8, "little") + pages[40:],   # pages: no head secret
               seg[:1] + bytes([2]) + seg[2:], pages[:1] + bytes([2]) + pages[2:]]   # old layout
        import random
        rnd = random.Random(5)
        bad += [bytes(rnd.randrange(256) for _ in range(n)) for n in (40, 64, 104, 200)]
        for data in bad:
            rc, msg = c.open(data, 2 * g)
            assert rc == EINVAL, (data, rc, msg)
            assert msg, data
        assert c.open(seg, 0)[0] == EINVAL
        for k in range(6):
            assert fake.fake_share_count(k) == 0, k    # no descriptor taken, nothing imported
        # a descriptor number the producer does not have: refused by the kernel, no crash
        wrong = seg[:24] + (999).to_bytes(4, "little") + seg[28:]
        rc, msg = c.open(wrong, 1 << 20)
        assert rc == EINVAL and "descriptor" in msg, msg
        release()
        rc, msg = c.open(seg, 1 << 20)                 # the producer has exited
        assert rc == EINVAL and "gone" in msg, msg
        c.destroy()
    """)


def test_a_handle_opened_in_the_process_that_made_it_gives_its_own_memory(fake_driver):
    run(fake_driver, f"""
        g = {G}
        c = Cuda(0, shareable_pool=True)
        c.set_shareable(1)
        seg = c.segment(1 << 20)
        rc, data = c.share(seg, 1 << 20)
        other = Cuda(0)
        assert other.open(data, 1 << 20) == (OK, seg)
        va = c.reserve(4 * g)
        c.map(va, 2 * g)
        rc, pages = c.share(va, 2 * g, 1)
        assert other.open(pages, 2 * g) == (OK, va)
        assert fake.fake_share_count(2) == 0 and fake.fake_share_count(5) == 0
        assert other.close(seg, 1 << 20) == OK and other.close(va, 2 * g) == OK
        c.unmap(va, 2 * g)
        c.map(va, 2 * g)                               # other memory at the same address
        rc, msg = other.open(pages, 2 * g)
        assert rc == EINVAL and "no longer" in msg, msg
        c.unmap(va, 2 * g)
        other.destroy()
        c.destroy()
    """)


def test_a_device_that_cannot_reach_the_memory_undoes_the_import(fake_driver):
    # Device 2 of the fake reaches no other device: granting it access fails, and what was
    # imported for the open goes again (the pool import, the mapped pages).
    run(fake_driver, f"""
        g = {G}
        {SEGMENT_AND_PAGES}
        c = Cuda(2)
        rc, msg = c.open(bytes.fromhex(out["seg"]), 1 << 20)
        assert rc == EUPSTREAM and "cuMemPoolSetAccess" in msg, msg
        assert fake.fake_live_imported_pools() == 0 and fake.fake_share_count(3) == 0
        rc, msg = c.open(bytes.fromhex(out["pages"]), 2 * g)
        assert rc == EUPSTREAM and "cuMemSetAccess" in msg, msg
        assert fake.fake_share_count(5) == 1            # imported (one allocation), undone:
        assert fake.fake_mapped_pages() == 0 and fake.fake_live_handles() == 0
        ok = Cuda(0)                                    # a device that can: opens
        rc, base = ok.open(bytes.fromhex(out["seg"]), 1 << 20)
        assert rc == OK, base
        assert ok.close(base, 1 << 20) == OK
        release()
        c.destroy()
        ok.destroy()
    """)


def test_descriptors_come_through_the_producers_server_too(fake_driver):
    # The consumer asks the producer's descriptor server only (Note [Passing descriptors]):
    # the pool's descriptor and each allocation's were offered when shared.
    run(fake_driver, f"""
        g = {G}
        {SEGMENT_AND_PAGES}
        core.mp_fd_force_socket(1)
        seg, pages = bytes.fromhex(out["seg"]), bytes.fromhex(out["pages"])
        c = Cuda(1)
        rc, base = c.open(seg, 1 << 20)
        assert rc == OK, base
        assert fake.fake_share_count(2) == 1 and fake.fake_share_count(3) == 1
        assert c.close(base, 1 << 20) == OK
        rc, base = c.open(pages, 2 * g)
        assert rc == OK, base
        assert fake.fake_share_count(5) == 1
        assert c.close(base, 2 * g) == OK
        # a number the producer never offered (its standard output): refused by the server
        wrong = seg[:24] + (1).to_bytes(4, "little") + seg[28:]
        rc, msg = c.open(wrong, 1 << 20)
        assert rc == EINVAL and "no shared descriptor 1" in msg, msg
        # offered numbers, asked without their own secrets (the pool descriptor's at bytes
        # 32-39, each allocation's at bytes 24-31 of its piece): refused too
        for data, n, at in ((seg, 1 << 20, 32), (pages, 2 * g, 40 + 24)):
            hostile = data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]
            rc, msg = c.open(hostile, n)
            assert rc == EINVAL and "secret" in msg, msg
        # one handle's secret opens no other descriptor: the segment's handle carrying the
        # pages' secret, and the pages' handle carrying the segment's, are refused
        assert pages[32:40] == bytes(8) and seg[32:40] != pages[64:72]
        rc, msg = c.open(seg[:32] + pages[64:72] + seg[40:], 1 << 20)
        assert rc == EINVAL and "secret" in msg, msg
        rc, msg = c.open(pages[:64] + seg[32:40] + pages[72:], 2 * g)
        assert rc == EINVAL and "secret" in msg, msg
        assert fake.fake_share_count(2) == 1 and fake.fake_share_count(5) == 1
        release()
        rc, msg = c.open(seg, 1 << 20)                 # the producer has exited
        assert rc == EINVAL and "gone" in msg, msg
        c.destroy()
    """)
