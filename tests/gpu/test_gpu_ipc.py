"""Pool.export and Pool.import_ on backend="cuda" across spawned processes, with CuPy kernels
reading and writing the memory (Note [Sharing CUDA memory], mempool/_csrc/upstream/
mp_cuda_share.c): both ways, expandable segments too, and a block its producer freed kept
until the consumer let go. Each case runs as a script in a fresh interpreter
(tests/_ipc_scripts.py)."""
import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

from _ipc_scripts import run_script  # noqa: E402

# Parent and child on pools made to share; the parent exports a block filled with 3 * i,
# the child imports it, checks it and exports one of its own filled with 5 * i, which the
# parent imports and checks. argv: 1 for expandable segments.
BOTH_WAYS = """
import multiprocessing as mp
import sys
import cupy
import mempool

N = 1 << 20


def view(ptr, owner):
    mem = cupy.cuda.UnownedMemory(ptr, N * 4, owner, 0)
    return cupy.ndarray((N,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))


def make(expandable):
    return mempool.Pool(backend="cuda", device=0, ipc=True, expandable_segments=expandable)


def child(inq, outq, expandable):
    pool = make(expandable)
    handle = inq.get(timeout=120)
    try:
        buf = pool.import_(handle)
    except Exception as exc:
        outq.put(("refused", f"{type(exc).__name__}: {exc}"))
        return
    with buf:
        same = bool((view(buf.ptr, buf) == cupy.arange(N, dtype=cupy.uint32) * 3).all())
        mine = pool.alloc(N * 4)
        view(mine, pool)[:] = cupy.arange(N, dtype=cupy.uint32) * 5
        cupy.cuda.Device(0).synchronize()
        outq.put(("got", same, pool.export(mine)))
        inq.get(timeout=120)                    # the parent let go of it
    pool.free(mine)
    pool.collect_shared()


if __name__ == "__main__":
    expandable = sys.argv[1] == "1"
    mp.set_start_method("spawn")
    pool = make(expandable)
    ptr = pool.alloc(N * 4)
    view(ptr, pool)[:] = cupy.arange(N, dtype=cupy.uint32) * 3
    handle = pool.export(ptr)                   # waits for the block's stream
    inq, outq = mp.Queue(), mp.Queue()
    p = mp.Process(target=child, args=(inq, outq, expandable))
    p.start()
    inq.put(handle)
    first = outq.get(timeout=120)
    if first[0] == "refused":
        print("REFUSED", first[1])
    else:
        assert first[1], "the child read other values than the parent wrote"
        with pool.import_(first[2]) as theirs:
            got = view(theirs.ptr, theirs)
            assert bool((got == cupy.arange(N, dtype=cupy.uint32) * 5).all())
        inq.put(None)
        print("BOTH WAYS")
    p.join(120)
    assert p.exitcode == 0, p.exitcode
    pool.free(ptr)
    pool.collect_shared()
    assert pool.used_bytes() == 0, pool.used_bytes()
"""


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_blocks_go_both_ways_between_spawned_processes(tmp_path, expandable):
    out = run_script(tmp_path, BOTH_WAYS, int(expandable))
    # Under Yama's ptrace_scope=1 too: the child takes its parent's descriptors from the
    # parent's descriptor server.
    assert "BOTH WAYS" in out, out


# The parent imports what its child exported (a parent may take its child's descriptors
# under Yama too); the child frees the block while the parent still reads it, and its
# later blocks must not land there until the parent let go and the child collected.
FREED_WHILE_READ = """
import multiprocessing as mp
import cupy
import mempool

N = 1 << 20


def view(ptr, owner):
    mem = cupy.cuda.UnownedMemory(ptr, N * 4, owner, 0)
    return cupy.ndarray((N,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))


def child(inq, outq):
    pool = mempool.Pool(backend="cuda", device=0, ipc=True)
    ptr = pool.alloc(N * 4)
    view(ptr, pool)[:] = 7
    outq.put(pool.export(ptr))
    inq.get(timeout=120)                       # the parent has it open
    pool.free(ptr)                             # freed while the parent reads it
    others = [pool.alloc(N * 4) for _ in range(4)]
    for o in others:
        view(o, pool)[:] = 0
    cupy.cuda.Device(0).synchronize()
    outq.put(ptr in others)
    for o in others:
        pool.free(o)
    inq.get(timeout=120)                       # the parent let go
    outq.put(pool.collect_shared())


if __name__ == "__main__":
    mp.set_start_method("spawn")
    pool = mempool.Pool(backend="cuda", device=0)
    inq, outq = mp.Queue(), mp.Queue()
    p = mp.Process(target=child, args=(inq, outq))
    p.start()
    buf = pool.import_(outq.get(timeout=120))
    inq.put(None)
    assert outq.get(timeout=120) is False, "the producer reused a block a consumer reads"
    assert bool((view(buf.ptr, buf) == 7).all()), "the block changed under the consumer"
    buf.close()
    inq.put(None)
    assert outq.get(timeout=120) >= 1, "collect_shared gave nothing back"
    p.join(120)
    assert p.exitcode == 0, p.exitcode
    print("KEPT")
"""


def test_a_block_its_producer_freed_stays_until_the_consumer_let_go(tmp_path):
    assert "KEPT" in run_script(tmp_path, FREED_WHILE_READ)
