"""mempool.dask on a real device: one GPU worker process whose pool serves a CuPy
workload, seen from the client through the report and the metrics endpoint."""
import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)
distributed = pytest.importorskip("distributed", reason="pip install distributed")

import mempool.dask as md     # noqa: E402

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def _cupy_workload(n):
    """A task: CuPy arrays and kernel temporaries (from the worker's pool once hooked)."""
    import cupy
    x = cupy.arange(n, dtype=cupy.float32)
    y = cupy.sqrt(x) * 2 + 1
    return float(y.sum(dtype=cupy.float64))


def _on_pool(n):
    import cupy
    x = cupy.ones(n, dtype=cupy.float32)
    return md.worker_pool().block_info(x.data.ptr)[1]


def test_a_gpu_worker_runs_cupy_on_its_pool():
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                       dashboard_address=None,
                                       worker_dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        result = client.register_plugin(
            md.MempoolPlugin("release_threshold:1GiB,limit:4GiB", frameworks=["cupy"]))
        assert {r["status"] for r in result.values()} == {"OK"}, result
        n = 1 << 24
        value = client.submit(_cupy_workload, n, pure=False).result(timeout=120)
        import numpy
        expected = float((numpy.sqrt(numpy.arange(n, dtype=numpy.float64)) * 2 + 1).sum())
        assert abs(value - expected) <= 1e-4 * expected
        assert client.submit(_on_pool, 1 << 20, pure=False).result(timeout=60) == 4 * MiB
        (info,) = md.gather(client).values()
        assert (info["backend"], info["device"]) == ("cuda", 0)
        assert info["hooks"] == {"cupy": "hooked"}
        assert info["stats"]["allocation.all.allocated"] >= 4      # x, y and temporaries
        assert info["stats"]["allocated_bytes.all.peak"] >= 2 * 64 * MiB
        assert info["stats"]["num_ooms"] == 0
        text = md.report(client)
        assert "cuda device 0" in text and "hooks: cupy hooked" in text
        pytest.importorskip("prometheus_client", reason="pip install prometheus-client")
        # Imported here: the worker imports this module for its task functions, and on its
        # path bench's conftest may come first.
        from _support import fetch_text
        with md.serve_metrics(client, port=0) as server:
            metrics = fetch_text(server.url, timeout=10)
        assert 'mempool_limit_bytes{backend="cuda",device="0",pool=' in metrics
        assert "4.294967296e+09" in metrics
