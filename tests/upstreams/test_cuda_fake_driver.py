"""Peer access in the CUDA upstream (mempool/_csrc/upstream/mp_cuda_peers.c), on a stand-in
driver.

The upstream resolves its driver calls from libcuda.so.1 at run time, so a fake driver
(tests/data/fake_libcuda.c: four devices, of which 0, 1 and 3 are peers, with access recorded
per page and per memory pool) stands in for one on a machine with no GPU. Each test runs in a
fresh interpreter that loads the fake before the upstream first looks for the driver, and
calls the upstream's C functions through ctypes: the real code, the fake hardware. What the
real driver does is the GPU tier's to check (tests/gpu/test_gpu_multigpu.py).
"""
from _fake_cuda import G, run_fake

def test_pages_mapped_before_and_after_enabling_get_the_peer(fake_driver):
    run_fake(fake_driver, f"""
        c = Cuda(0)
        g = c.g
        assert g == {G}
        va = c.reserve(8 * g)
        assert c.map(va, 2 * g) == OK
        assert c.pages(va, 3) == [1, 1, -1]           # mapped for device 0 alone
        assert c.peers() == [] and fake.fake_pool_access(c.pool) == 1

        assert c.enable(1) == (OK, "")
        assert c.pages(va, 3) == [3, 3, -1]           # the pages mapped before: granted
        assert fake.fake_pool_access(c.pool) == 3     # and the cudaMemPool's segments
        assert c.map(va + 4 * g, 2 * g) == OK
        assert c.pages(va + 4 * g, 2) == [3, 3]       # pages mapped after: granted at map
        assert c.peers() == [1]

        assert c.access(va, 2 * g) == (OK, 3)
        assert c.access(va + 4 * g + 512, 1024) == (OK, 3)
        assert c.access(va + g, 4 * g) == (OK, 0)     # crosses unmapped pages
        assert c.access(c.segment(1 << 20), 1 << 20) == (OK, 3)   # pool memory

        calls = (fake.fake_set_access_calls(), fake.fake_pool_set_access_calls())
        assert c.enable(1) == (OK, "")                # idempotent: nothing more asked
        assert (fake.fake_set_access_calls(), fake.fake_pool_set_access_calls()) == calls

        assert c.unmap(va, g) == EINVAL               # half of one physical allocation
        assert c.unmap(va, 2 * g) == OK and c.map(va, g) == OK
        assert c.pages(va, 2) == [3, -1]              # re-mapped after a release: granted
        assert c.unmap(va, g) == OK and c.unmap(va + 4 * g, 2 * g) == OK
        assert c.release(va, 8 * g) == OK
        c.destroy()
    """)


def test_every_run_of_mapped_pages_is_granted(fake_driver):
    run_fake(fake_driver, """
        c = Cuda(0)
        g = c.g
        a, b = c.reserve(8 * g), c.reserve(4 * g)
        for va, page in [(a, 0), (a, 2), (a, 3), (a, 7), (b, 1)]:
            assert c.map(va + page * g, g) == OK
        before = fake.fake_set_access_calls()
        assert c.enable(3) == (OK, "")
        # runs: a[0], a[2:4], a[7], b[1]: one cuMemSetAccess each (a run spans its pages)
        assert fake.fake_set_access_calls() - before == 4
        assert c.pages(a, 8) == [9, -1, 9, 9, -1, -1, -1, 9]   # devices 0 and 3
        assert c.pages(b, 4) == [-1, 9, -1, -1]
        assert c.enable(1) == (OK, "")
        assert c.peers() == [1, 3]                    # ascending, whatever the order enabled
        assert c.pages(a, 1) == [11] and fake.fake_pool_access(c.pool) == 11
        assert c.map(b + 3 * g, g) == OK and c.pages(b + 3 * g, 1) == [11]
    """)


def test_bad_peers_are_refused_and_change_nothing(fake_driver):
    run_fake(fake_driver, """
        c = Cuda(0)
        va = c.reserve(4 * c.g)
        assert c.map(va, c.g) == OK
        calls = fake.fake_set_access_calls()
        for peer, code, words in [(-1, EINVAL, "in [0, 4), got -1"),
                                  (4, EINVAL, "in [0, 4), got 4"),
                                  (0, EINVAL, "peer_device 0 is the pool's own device"),
                                  (2, EUNSUPPORTED, "device 2 cannot access the memory of "
                                                    "device 0")]:
            rc, msg = c.enable(peer)
            assert rc == code and words in msg, (peer, rc, msg)
        assert c.peers() == [] and c.pages(va, 1) == [1]
        assert fake.fake_pool_access(c.pool) == 1 and fake.fake_set_access_calls() == calls
    """)


def test_enabling_is_all_or_nothing(fake_driver):
    run_fake(fake_driver, """
        c = Cuda(0)
        g = c.g
        va = c.reserve(8 * g)
        for page in (0, 2, 4):                        # three separate runs
            assert c.map(va + page * g, g) == OK
        fake.fake_fail_set_access_after(1)            # the second run's grant fails
        rc, msg = c.enable(1)
        assert rc == EUPSTREAM and "cuMemSetAccess" in msg and "CUDA_ERROR_UNKNOWN" in msg, msg
        assert c.pages(va, 5) == [1, -1, 1, -1, 1]    # the first run's grant was revoked
        assert fake.fake_pool_access(c.pool) == 1 and c.peers() == []

        fake.fake_fail_pool_access()                  # the pages pass, the pool fails
        rc, msg = c.enable(1)
        assert rc == EUPSTREAM and "cuMemPoolSetAccess" in msg, msg
        assert c.pages(va, 5) == [1, -1, 1, -1, 1] and c.peers() == []
        assert c.map(va + 6 * g, g) == OK and c.pages(va + 6 * g, 1) == [1]   # not granted

        assert c.enable(1) == (OK, "")                # nothing half-done stands in the way
        assert c.pages(va, 7) == [3, -1, 3, -1, 3, -1, 3] and c.peers() == [1]
    """)


def test_an_upstream_on_device_1_grants_device_0(fake_driver):
    run_fake(fake_driver, """
        c = Cuda(1)
        va = c.reserve(2 * c.g)
        assert c.map(va, c.g) == OK and c.pages(va, 1) == [2]
        assert c.enable(1)[0] == EINVAL               # its own device
        assert c.enable(0) == (OK, "")
        assert c.pages(va, 1) == [3] and fake.fake_pool_access(c.pool) == 3
        assert c.access(va, c.g) == (OK, 3)
    """)


def test_without_virtual_memory_the_pool_alone_is_granted(fake_driver):
    run_fake(fake_driver, """
        c = Cuda(0)
        assert c.g == 0                               # no expandable segments
        assert c.enable(3) == (OK, "")
        assert fake.fake_pool_access(c.pool) == 9 and fake.fake_set_access_calls() == 0
        assert c.peers() == [3]
        assert c.access(c.segment(4096), 4096) == (OK, 9)
    """, FAKE_NO_VMM="1")


def test_a_map_call_is_one_physical_allocation_unmapped_only_whole(fake_driver):
    """Note [Expandable pages]: whatever the page (any power of two times the driver's
    granularity, the `granularity` option), a map call is one cuMemCreate of its whole range,
    one cuMemMap and one cuMemSetAccess; an unmap covers whole allocations, one or several
    (the driver unmaps only whole mappings, and the fake refuses anything else), and a cut
    one is refused with nothing changed."""
    run_fake(fake_driver, f"""
        c = Cuda(0)
        assert c.set_page(3 << 20)[0] == EINVAL       # not a multiple of 2 MiB
        assert c.set_page(6 * {G})[0] == EINVAL       # nor a power of two times it
        rc, why = c.set_page(0)
        assert rc == EINVAL and "allocation granularity" in why and "power of two" in why, why
        assert c.g == {G}                              # refused: unchanged
        assert c.set_page(4 * {G}) == (OK, "")
        assert c.g == 4 * {G}
        g = c.g
        va = c.reserve(8 * g)
        rc, why = c.set_page(2 * {G})
        assert rc == EBUSY and "reserved" in why, why
        assert c.g == 4 * {G}
        assert va % g == 0                             # reservations aligned to the page
        calls = (fake.fake_create_calls(), fake.fake_map_calls(), fake.fake_set_access_calls())
        assert c.map(va, 3 * g) == OK                  # three pages of 8 MiB: one allocation
        assert c.map(va + 3 * g, 2 * g) == OK          # and two more: another
        now = (fake.fake_create_calls(), fake.fake_map_calls(), fake.fake_set_access_calls())
        assert [b - a for a, b in zip(calls, now)] == [2, 2, 2]
        assert fake.fake_live_handles() == 2
        assert fake.fake_mapped_pages() == 20          # the fake counts 2 MiB granules
        for bad in [(va + g, g), (va, g), (va, 4 * g), (va + g, 4 * g)]:
            assert c.unmap(*bad) == EINVAL, bad        # each cuts an allocation
        assert fake.fake_mapped_pages() == 20 and fake.fake_live_handles() == 2
        assert c.unmap(va, 5 * g) == OK                # both whole, in one call
        assert fake.fake_mapped_pages() == 0 and fake.fake_live_handles() == 0
        assert c.map(va + g, g) == OK and c.unmap(va + g, g) == OK
        assert c.release(va, 8 * g) == OK
        c.destroy()
    """)


def test_the_page_size_is_refused_without_virtual_memory(fake_driver):
    run_fake(fake_driver, """
        c = Cuda(0)
        rc, why = c.set_page(8 << 20)
        assert rc == EUNSUPPORTED and "virtual memory management" in why, why
        c.destroy()
    """, FAKE_NO_VMM="1")
