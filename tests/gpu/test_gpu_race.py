"""The real cross-stream races: a kernel still reading a block on one stream while another
stream is handed memory at once.

Each test queues a ~50 ms device-side spin before a read, frees the block while the spin
runs, and lets another stream allocate and write immediately. If the pool handed the same
memory out without ordering the second stream after the first (an event wait, or holding the
block until the reader's event completes), the late read would see the second writer's data.
"""
import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

MiB = 1 << 20
N = 8 * MiB             # a large-pool block: it comes from a 20 MiB segment
SEGMENT = 20 * MiB
SPIN_MS = 50
A_SEED, B_SEED = 0xA0A0A0A0, 0x0B0B0B0B


def _written_on_a_read_on_b(pool, a, b, kernels, result, cupy):
    """A block allocated and filled on A, then read on B for ~50 ms (B ordered after A's
    write by an event): the shape of every test below."""
    blk = pool.alloc(N, stream=a)
    kernels.fill(blk, N, A_SEED, stream=a)
    written = cupy.cuda.Event(disable_timing=True)
    written.record(a)
    b.wait_event(written)
    kernels.spin_copy(blk, result.data.ptr, N, SPIN_MS, stream=b)
    return blk


@pytest.fixture
def result(cupy_device):
    """Where a racing reader copies what it saw: CuPy's own memory, outside the pool."""
    return cupy_device.empty(N // 4, dtype=cupy_device.uint32)


@pytest.mark.parametrize("cross_stream_reuse", [True, False])
def test_free_on_a_then_alloc_on_b(cuda_pool, streams, kernels, result, cross_stream_reuse):
    pool = cuda_pool(cross_stream_reuse=cross_stream_reuse)
    a, b = streams
    blk = pool.alloc(N, stream=a)
    kernels.fill(blk, N, A_SEED, stream=a)
    kernels.spin_copy(blk, result.data.ptr, N, SPIN_MS, stream=a)  # A reads blk ~50 ms on
    pool.free(blk, stream=a)
    blk2 = pool.alloc(N, stream=b)  # at once, while A is still spinning
    kernels.fill(blk2, N, B_SEED, stream=b)
    if cross_stream_reuse:
        # B took A's free memory (through an event wait): the race was really run.
        assert blk <= blk2 < blk + SEGMENT, "B did not reuse A's segment; nothing raced"
    a.synchronize()
    b.synchronize()
    assert kernels.count_bad(result.data.ptr, N, A_SEED, a) == 0, \
        "B's write reached memory A was still reading"
    assert kernels.count_bad(blk2, N, B_SEED, b) == 0, "A's late work overwrote B's block"
    pool.free(blk2, stream=b)


def test_record_stream_holds_the_block_for_the_other_stream(cuda_pool, streams, kernels,
                                                             result, cupy_device):
    cupy = cupy_device
    pool = cuda_pool()
    a, b = streams
    blk = _written_on_a_read_on_b(pool, a, b, kernels, result, cupy)   # B still reading it
    pool.record_stream(blk, b)
    pool.free(blk)  # on its own stream A, whose work with it is done; B's is not
    blk2 = pool.alloc(N, stream=a)
    kernels.fill(blk2, N, B_SEED, stream=a)
    a.synchronize()
    b.synchronize()
    assert kernels.count_bad(result.data.ptr, N, A_SEED, b) == 0, \
        "the block was reused on A while B was still reading it"
    assert kernels.count_bad(blk2, N, B_SEED, a) == 0
    pool.free(blk2, stream=a)
    pool.check_invariants()
    # B's event has completed: the held block is free again and serves A.
    blk3 = pool.alloc(N, stream=a)
    pool.free(blk3, stream=a)
    pool.check_invariants()
    assert pool.used_bytes() == 0


def test_free_on_the_stream_of_last_use(cuda_pool, streams, kernels, result, cupy_device):
    cupy = cupy_device
    pool = cuda_pool()
    a, b = streams
    blk = _written_on_a_read_on_b(pool, a, b, kernels, result, cupy)
    pool.free(blk, stream=b)  # B is where the block was last used
    blk2 = pool.alloc(N, stream=a)
    kernels.fill(blk2, N, B_SEED, stream=a)
    a.synchronize()
    b.synchronize()
    assert kernels.count_bad(result.data.ptr, N, A_SEED, b) == 0, \
        "A got the block before B's last use of it had finished"
    assert kernels.count_bad(blk2, N, B_SEED, a) == 0
    pool.free(blk2, stream=a)


def test_control_without_record_stream_the_race_is_real(cuda_pool, streams, kernels, result,
                                                         cupy_device):
    """The same steps as the record_stream test, without the declaration the contract asks
    for: the block is reused on A at once and B reads A's new data. This shows the tests
    above would see a missing wait."""
    cupy = cupy_device
    pool = cuda_pool()
    a, b = streams
    blk = _written_on_a_read_on_b(pool, a, b, kernels, result, cupy)
    pool.free(blk)
    blk2 = pool.alloc(N, stream=a)
    assert blk2 == blk, "stream order lets A reuse its own freed block at once"
    kernels.fill(blk2, N, B_SEED, stream=a)
    a.synchronize()
    b.synchronize()
    assert kernels.count_bad(result.data.ptr, N, A_SEED, b) > 0
    pool.free(blk2, stream=a)


def test_ping_pong_between_streams(cuda_pool, streams, kernels, result):
    """Many short races in a row, each stream taking what the other just freed."""
    pool = cuda_pool()
    pair = streams
    for i in range(40):
        src, dst = pair[i % 2], pair[(i + 1) % 2]
        seed = 0x1000 + i
        blk = pool.alloc(N, stream=src)
        kernels.fill(blk, N, seed, stream=src)
        kernels.spin_copy(blk, result.data.ptr, N, 2, stream=src)
        pool.free(blk, stream=src)
        other = pool.alloc(N, stream=dst)
        kernels.fill(other, N, ~seed, stream=dst)
        assert kernels.count_bad(result.data.ptr, N, seed, src) == 0, f"round {i}"
        assert kernels.count_bad(other, N, ~seed, dst) == 0, f"round {i}"
        pool.free(other, stream=dst)
    pool.check_invariants()
    assert pool.used_bytes() == 0
