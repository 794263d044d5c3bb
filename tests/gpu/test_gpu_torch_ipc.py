"""CUDA tensors across processes under the pool: what is refused, and receiving from a process on
PyTorch's allocator.

The scripts use PyTorch's own API only, as a training or inference script would, and check
that the answers are the pool's (each in a fresh interpreter: tests/_torch_scripts.py)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from _torch_scripts import PRELUDE, run, NATIVE_PRELUDE  # noqa: E402


def test_ipc_export_is_refused_clearly():
    run("""
        x = torch.ones(16, device="cuda")
        try:
            x.untyped_storage()._share_cuda_()
        except RuntimeError as exc:
            assert "mempool" in str(exc) and "another process" in str(exc), str(exc)
        else:
            raise AssertionError("sharing was not refused")
    """)


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


PRODUCER = """
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
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE,
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
