"""CUDA tensors across processes under the pool (Note [Torch allocator glue], mp_torch.h):
sent through torch.multiprocessing both ways, rebuilt from reduce_tensor, kept for a
consumer after the producer freed them, and received from a process on PyTorch's own
allocator.

The scripts use PyTorch's own API only, as a training or inference script would, each in a
fresh interpreter (tests/_torch_scripts.py, tests/_ipc_scripts.py)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _ipc_scripts import run_script  # noqa: E402
from _torch_scripts import NATIVE_PRELUDE, PRELUDE, run  # noqa: E402

# A parent and a child, each on its own pool made to share (ipc=True): the parent sends a
# tensor through a torch.multiprocessing queue, the child checks it and sends back one of
# its own. argv: the start method, 1 for expandable segments (0 for fixed ones, "switched"
# for fixed ones with PyTorch's expandable_segments turned on at run time in the parent, so
# that its tensor is a companion pool's: Note [Segment kind at run time]).
BOTH_WAYS = """
import sys
import torch
import torch.multiprocessing as mp
import mempool
import mempool.torch as mt

N = 1 << 20


def install(expandable):
    pool = mempool.Pool(backend="cuda", device=0, ipc=True, expandable_segments=expandable)
    mt.install(pool, allocator="full")
    return pool


def child(inq, outq, expandable):
    pool = install(expandable)
    try:
        x = inq.get(timeout=120)
    except RuntimeError as exc:
        outq.put(("refused", str(exc)))
        return
    same = torch.equal(x, torch.arange(N, dtype=torch.float32, device="cuda") * 3)
    y = x * 2                                   # the child's own tensor, from its pool
    outq.put(("got", same, pool.used_bytes() >= y.nbytes))
    outq.put(y)
    inq.get(timeout=120)                        # the parent has read y
    del x, y


if __name__ == "__main__":
    method, expandable, switched = sys.argv[1], sys.argv[2] == "1", sys.argv[2] == "switched"
    mp.set_start_method(method)
    pool = install(expandable)
    if switched:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    inq, outq = mp.Queue(), mp.Queue()
    p = mp.Process(target=child, args=(inq, outq, expandable))
    p.start()
    x = torch.arange(N, dtype=torch.float32, device="cuda") * 3
    inq.put(x)
    first = outq.get(timeout=120)
    if first[0] == "refused":
        print("REFUSED", first[1])
    else:
        assert first[1], "the child read other values than the parent sent"
        assert first[2], "the child's tensor is not its pool's"
        y = outq.get(timeout=120)               # the parent opens the child's tensor
        assert torch.equal(y, x * 2), "the parent read other values than the child sent"
        if switched:   # x and y are the companion's, which the device's figures count
            assert pool.used_bytes() == 0
            assert any(seg["is_expandable"] for seg in torch.cuda.memory_snapshot())
        else:
            assert torch.cuda.memory_allocated() == pool.stats()["allocated_bytes.all.current"]
        del y
        inq.put(None)
        print("BOTH WAYS")
    p.join(120)
    assert p.exitcode == 0, p.exitcode
"""


@pytest.mark.parametrize("expandable", ["0", "1", "switched"],
                         ids=["segments", "expandable", "switched-at-run-time"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_tensor_goes_both_ways_between_two_processes(tmp_path, method, expandable):
    out = run_script(tmp_path, BOTH_WAYS, method, expandable)
    # Under Yama's ptrace_scope=1 too: the child takes its parent's descriptors from the
    # parent's descriptor server.
    assert "BOTH WAYS" in out, out


# The consumer runs the producer as its child (so that it may take its descriptors under
# Yama too); the producer sends reduce_tensor's pickle, frees its tensor on "free", then
# allocates and overwrites as much again, reporting whether any block came back at the
# freed one's address; on "collect" it runs torch.cuda.ipc_collect() and reports what the
# pool holds.
PRODUCER = PRELUDE.replace('device=0)', 'device=0, ipc=True{options})') + """
import base64, pickle, sys
from torch.multiprocessing.reductions import reduce_tensor
x = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 3
where = x.data_ptr()
print(base64.b64encode(pickle.dumps(reduce_tensor(x))).decode(), flush=True)
sys.stdin.readline()
del x
held = pool.used_bytes()
others = [torch.zeros(1 << 20, device="cuda") for _ in range(8)]
torch.cuda.synchronize()
print(int(any(o.data_ptr() == where for o in others)), held, flush=True)
del others
sys.stdin.readline()
torch.cuda.ipc_collect()
print(pool.used_bytes(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("options", ["", ", expandable_segments=True"],
                         ids=["segments", "expandable"])
def test_a_block_freed_by_its_producer_stays_until_the_consumer_let_go(options):
    producer = PRODUCER.replace("{options}", options)
    out = run(f"""
        import base64, pickle, subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", {producer!r}], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        rebuild, args = pickle.loads(base64.b64decode(p.stdout.readline()))
        y = rebuild(*args)                       # rebuild_cuda_tensor: opens the handle
        expect = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 3
        assert torch.equal(y, expect)
        p.stdin.write("free\\n"); p.stdin.flush()
        reused, held = map(int, p.stdout.readline().split())
        assert reused == 0, "the producer reused a block a consumer still reads"
        assert held >= 4 << 20, held
        assert torch.equal(y, expect), "the block changed under the consumer"
        del y, rebuild, args
        torch.cuda.synchronize()
        p.stdin.write("collect\\n"); p.stdin.flush()
        after = int(p.stdout.readline())
        assert after < held, (after, held)       # ipc_collect gave the block back
        p.stdin.write("done\\n"); p.stdin.flush()
        assert p.wait(60) == 0
        print("kept until let go")
    """)
    assert "kept until let go" in out


def test_a_pool_not_made_to_share_refuses_saying_how():
    run("""
        x = torch.ones(16, device="cuda")
        try:
            x.untyped_storage()._share_cuda_()
        except RuntimeError as exc:
            assert "mempool" in str(exc) and "ipc=True" in str(exc), str(exc)
        else:
            raise AssertionError("sharing was not refused")
    """, prelude=PRELUDE.replace('device=0)', 'device=0, ipc=False)'))


def test_sharing_memory_the_pool_did_not_hand_out_is_an_invalid_device_pointer():
    # shareIpcHandle (what _share_cuda_ asks) and getBaseAllocation of CuPy's memory seen
    # through DLPack, where no block of the allocator starts: PyTorch's allocator raises
    # "invalid device pointer"; the pool named IPC instead of the pointer, and
    # getBaseAllocation returned the pointer as its own base.
    for prelude in (NATIVE_PRELUDE, PRELUDE):
        out = run("""
            import cupy
            foreign = torch.from_dlpack(cupy.ones(1 << 16, dtype=cupy.float32))
            try:
                foreign.untyped_storage()._share_cuda_()
            except RuntimeError as exc:
                assert "invalid device pointer" in str(exc), str(exc)
            else:
                raise AssertionError("a base allocation was found for CuPy's memory")
            print("refused as an invalid device pointer")
        """, prelude=prelude)
        assert "refused as an invalid device pointer" in out, out


NATIVE_PRODUCER = """
import base64, pickle, sys, torch
from torch.multiprocessing.reductions import reduce_tensor
x = torch.arange(4096, dtype=torch.float32, device="cuda") * 3
rebuild, args = reduce_tensor(x)     # what torch.multiprocessing sends for a CUDA tensor
torch.cuda.synchronize()
print(base64.b64encode(pickle.dumps((rebuild, args))).decode(), flush=True)
sys.stdin.readline()                 # keep the tensor alive until the receiver is done
"""


def test_receiving_a_cuda_tensor_from_a_process_on_pytorchs_allocator():
    """The receiving side of torch.multiprocessing under install: the sender runs PyTorch's
    own allocator and exports a legacy IPC handle; the glue opens it (getIpcDevPtr)."""
    producer = subprocess.Popen([sys.executable, "-c", NATIVE_PRODUCER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        message = producer.stdout.readline().strip()
        assert message, "the sending process printed no handle"
        out = run(f"""
            import base64, pickle
            rebuild, args = pickle.loads(base64.b64decode({message!r}))
            y = rebuild(*args)
            assert y.device.type == "cuda" and y.shape == (4096,)
            expect = torch.arange(4096, dtype=torch.float32, device="cuda") * 3
            assert torch.equal(y, expect), "the received tensor's values differ"
            z = y * 2                        # and the pool serves the work done on it
            assert torch.cuda.memory_allocated() == pool.stats()["allocated_bytes.all.current"]
            print("received", float(z.sum()))
        """)
        assert "received" in out
    finally:
        producer.communicate("done\n", timeout=60)
