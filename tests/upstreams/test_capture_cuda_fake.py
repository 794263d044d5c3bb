"""The CUDA upstream during a graph capture (mp_cuda_capture.c, Note [Capture segments]), on the
stand-in driver of tests/_fake_cuda.py: a segment asked for on a capturing stream
comes from cuMemAlloc in the relaxed capture mode, never from the stream-ordered pool, and
goes back with cuMemFree, never with cuMemFreeAsync. What the real driver does is the GPU
tier's to check (tests/gpu/test_gpu_capture.py)."""
import textwrap

from _fake_cuda import run_fake

CAPTURE = r"""
cap = CFUNCTYPE(c_int, c_void_p, c_size_t, POINTER(c_int))
seg_free = CFUNCTYPE(c_int, c_void_p, c_size_t, c_size_t, c_size_t)
n = lambda what: fake.fake_capture_count(what)
PLAIN, RELAXED, POOL_ON_CAPTURING, POOL, FREE, FREE_ASYNC, FREE_IN_CAPTURE, MODE = range(8)
MAP_RELAXED, RESERVE_RELAXED = 8, 9
"""


def test_segments_of_a_capturing_stream_come_from_cumemalloc(fake_driver):
    run_fake(fake_driver, CAPTURE + textwrap.dedent("""
        c = Cuda(0)
        capturing = cap(c.up.stream_capturing)
        flag = c_int(-1)
        assert capturing(c.up.ctx, 0x77, byref(flag)) == OK and flag.value == 0
        fake.fake_begin_capture(0x77)
        assert capturing(c.up.ctx, 0x77, byref(flag)) == OK and flag.value == 1
        assert capturing(c.up.ctx, 0x88, byref(flag)) == OK and flag.value == 0
        assert capturing(c.up.ctx, 0, byref(flag)) == EUPSTREAM   # legacy: cannot be asked

        alloc = c._fn("segment_alloc", c_size_t, c_size_t, POINTER(c_size_t))
        out = c_size_t()
        assert alloc(c.up.ctx, 2 << 20, 0x77, byref(out)) == OK
        plain = out.value
        assert (n(PLAIN), n(RELAXED), n(POOL)) == (1, 1, 0)   # cuMemAlloc, relaxed mode
        assert n(MODE) == 0                                   # and the mode restored
        assert alloc(c.up.ctx, 2 << 20, 0, byref(out)) == OK  # legacy: counts as capturing
        legacy = out.value
        assert (n(PLAIN), n(RELAXED), n(POOL)) == (2, 2, 0)
        assert alloc(c.up.ctx, 2 << 20, 0x88, byref(out)) == OK   # not capturing: the pool
        pooled = out.value
        assert (n(PLAIN), n(POOL), n(POOL_ON_CAPTURING)) == (2, 1, 0)
        fake.fake_begin_capture(0)

        free = seg_free(c.up.segment_free)
        assert free(c.up.ctx, plain, 2 << 20, 0x77) == OK
        assert (n(FREE), n(FREE_ASYNC)) == (1, 0)            # cuMemFree, not stream-ordered
        assert free(c.up.ctx, pooled, 2 << 20, 0x88) == OK
        assert (n(FREE), n(FREE_ASYNC)) == (1, 1)
        assert free(c.up.ctx, legacy, 2 << 20, 0) == OK
        assert free(c.up.ctx, plain, 2 << 20, 0x77) == OK    # forgotten: stream-ordered now
        assert (n(FREE), n(FREE_ASYNC), n(FREE_IN_CAPTURE)) == (2, 2, 0)
        c.destroy()
    """))


def test_pages_are_reserved_and_mapped_in_the_relaxed_capture_mode(fake_driver):
    """A growth during a capture maps pages (as PyTorch's expandable segments do for a
    graph's pool): cuMemAddressReserve and cuMemMap are not stream-ordered, and the driver's
    global capture mode would refuse them."""
    run_fake(fake_driver, CAPTURE + textwrap.dedent("""
        c = Cuda(0)
        va = c.reserve(4 * c.g)
        assert c.map(va, 2 * c.g) == OK
        # one cuMemMap for both pages: one physical allocation (Note [Expandable pages])
        assert (n(RESERVE_RELAXED), n(MAP_RELAXED), n(MODE)) == (1, 1, 0)
        assert c.unmap(va, 2 * c.g) == OK and c.release(va, 4 * c.g) == OK
        c.destroy()
    """))


def test_private_pool_upstream_gives_plain_segments_on_every_stream(fake_driver):
    """mp_cuda_plain_upstream (Note [Torch allocator glue]): a CUDA graph's private pool takes
    only plain segments, whether or not the stream captures yet, and frees them with
    cuMemFree."""
    run_fake(fake_driver, CAPTURE + textwrap.dedent("""
        c = Cuda(0)
        plain_up = Upstream()
        core.mp_cuda_plain_upstream.argtypes = [c_void_p, c_void_p]
        assert core.mp_cuda_plain_upstream(byref(c.up), byref(plain_up)) == OK
        assert core.mp_cuda_plain_upstream(None, byref(plain_up)) == EINVAL
        alloc = CFUNCTYPE(c_int, c_void_p, c_size_t, c_size_t, POINTER(c_size_t))(
            plain_up.segment_alloc)
        free = seg_free(plain_up.segment_free)
        out = c_size_t()
        assert alloc(plain_up.ctx, 2 << 20, 0x88, byref(out)) == OK   # not capturing
        assert (n(PLAIN), n(RELAXED), n(POOL)) == (1, 1, 0)
        assert out.value % 512 == 0
        fake.fake_begin_capture(0x77)
        second = c_size_t()
        assert alloc(plain_up.ctx, 2 << 20, 0x77, byref(second)) == OK
        assert (n(PLAIN), n(POOL), n(POOL_ON_CAPTURING)) == (2, 0, 0)
        fake.fake_begin_capture(0)
        assert free(plain_up.ctx, out.value, 2 << 20, 0x88) == OK
        assert free(plain_up.ctx, second.value, 2 << 20, 0x77) == OK
        assert (n(FREE), n(FREE_ASYNC)) == (2, 0)
        assert plain_up.granularity == 0 and not plain_up.map
        CFUNCTYPE(None, c_void_p)(plain_up.destroy)(plain_up.ctx)
        c.destroy()
    """))


def test_pool_set_up_calls_run_in_the_relaxed_mode_then_the_mode_is_restored(fake_driver):
    """Note [Set-up during a capture]: Pool() puts the thread in the relaxed capture mode
    around its driver calls (a capture in the global mode refuses cudaMemPoolCreate) and puts
    the thread's own mode back after, whatever it was."""
    run_fake(fake_driver, CAPTURE + textwrap.dedent("""
        core.mp_cuda_relax_capture_mode.restype = c_int
        core.mp_cuda_restore_capture_mode.argtypes = [c_int]
        assert n(MODE) == 0                              # the global mode, CUDA's default
        mode = core.mp_cuda_relax_capture_mode()
        assert (mode, n(MODE)) == (0, 2)                 # relaxed now; global to restore
        core.mp_cuda_restore_capture_mode(mode)
        assert n(MODE) == 0
        mode = c_int(1)                                  # a thread in the thread-local mode
        fake.cuThreadExchangeStreamCaptureMode(byref(mode))
        mode = core.mp_cuda_relax_capture_mode()
        assert (mode, n(MODE)) == (1, 2)
        core.mp_cuda_restore_capture_mode(mode)
        assert n(MODE) == 1
        core.mp_cuda_restore_capture_mode(-1)            # nothing was changed: nothing to do
        assert n(MODE) == 1
    """))


def test_the_capture_order_is_read_from_the_drivers_graph(fake_driver):
    """Note [Capture reuse] on the CUDA upstream: capture_frontier reports the capturing
    stream's dependencies (cuStreamGetCaptureInfo), capture_follows walks
    cuGraphNodeGetDependencies back from them: counts first, then the nodes with their edge
    data (which the driver wants), past a first buffer of 16."""
    run_fake(fake_driver, CAPTURE + textwrap.dedent("""
        fake.fake_node_new.restype = c_void_p
        fake.fake_node_depends.argtypes = [c_void_p, c_void_p]
        fake.fake_frontier_add.argtypes = [c_void_p]
        c = Cuda(0)
        frontier = CFUNCTYPE(c_int, c_void_p, c_size_t, POINTER(c_uint64), POINTER(c_size_t),
                             c_size_t, POINTER(c_size_t))(c.up.capture_frontier)
        follows = CFUNCTYPE(c_int, c_void_p, c_size_t, POINTER(c_size_t), c_size_t,
                            POINTER(ctypes.c_ubyte))(c.up.capture_follows)
        root = fake.fake_node_new()
        side = fake.fake_node_new()               # a side stream's read, after root
        fake.fake_node_depends(side, root)
        wide = fake.fake_node_new()               # a join of 40 nodes, each after root
        for _ in range(40):
            k = fake.fake_node_new()
            fake.fake_node_depends(k, root)
            fake.fake_node_depends(wide, k)
        join = fake.fake_node_new()               # the main stream waits for both
        fake.fake_node_depends(join, side)
        fake.fake_node_depends(join, wide)
        apart = fake.fake_node_new()              # work no frontier waits for
        fake.fake_frontier_add(join)

        graph, nodes, got = c_uint64(), (c_size_t * 4)(), c_size_t()
        assert frontier(c.up.ctx, 0x77, byref(graph), nodes, 4, byref(got)) == EINVAL
        fake.fake_begin_capture(0x77)
        assert frontier(c.up.ctx, 0x77, byref(graph), nodes, 4, byref(got)) == OK
        assert (graph.value, got.value, nodes[0]) == (0x1234, 1, join)
        fake.fake_frontier_add(apart)
        assert frontier(c.up.ctx, 0x77, byref(graph), nodes, 1, byref(got)) == OK
        assert got.value == 2                     # more than the room: asked again with more

        fake.fake_frontier_add(None)
        fake.fake_frontier_add(join)
        def asks(*marks):
            arr = (c_size_t * len(marks))(*marks)
            each = (ctypes.c_ubyte * len(marks))(*([7] * len(marks)))
            assert follows(c.up.ctx, 0x77, arr, len(marks), each) == OK
            return list(each)
        assert asks(side) == [1] and asks(root, side, wide) == [1, 1, 1] and asks(join) == [1]
        assert asks(side, apart, root) == [1, 0, 1]   # apart is not before the frontier
        before = fake.fake_graph_calls(1)
        assert asks(root) == [1]
        # each of the 44 nodes once: its count, then its dependencies where it has any
        assert fake.fake_graph_calls(1) - before == 44 + 43
        fake.fake_begin_capture(0)
        arr, each = (c_size_t * 1)(side), (ctypes.c_ubyte * 1)()
        assert follows(c.up.ctx, 0x77, arr, 1, each) == EINVAL   # no capture now
        c.destroy()
    """))
