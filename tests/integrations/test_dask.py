"""mempool.dask on a process-based LocalCluster over the simulated device: a pool per
worker built from a conf string, registered after the workers started, rebuilt when a
worker restarts, gathered into one report and one Prometheus endpoint."""
import time

import pytest

MiB = 1 << 20
CONF = "backend:sim,capacity:1GiB,limit:64MiB"
TASK_TIMEOUT = 30           # seconds: a task that takes longer fails its test, never hangs it

distributed = pytest.importorskip("distributed", reason="pip install distributed")
import mempool                # noqa: E402
import mempool.dask as md     # noqa: E402


@pytest.fixture(scope="module")
def client():
    """Two worker processes, one thread each, no dashboards; the plugin is registered by
    each test, after the workers started. Workers import this module to run its task
    functions, so it imports no conftest at the top: on a worker's path, bench's may come
    first."""
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None,
                                       worker_dashboard_address=None)
    with cluster, distributed.Client(cluster) as c:
        c.wait_for_workers(2, timeout=30)
        yield c


def _register(client, conf=CONF, **kwargs):
    result = client.register_plugin(md.MempoolPlugin(conf, **kwargs))
    assert {r["status"] for r in result.values()} == {"OK"}, result
    return result


def _hold(nbytes):
    """A task: allocate from the worker's pool and keep the block (the task's result is
    its address)."""
    return md.worker_pool().alloc(nbytes)


def _overflow(nbytes):
    try:
        md.worker_pool().alloc(nbytes)
    except mempool.OutOfMemoryError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("args, kwargs, error, words", [
    (("nonsense_key:1",), {}, ValueError, "nonsense_key"),
    (("limit:lots",), {}, ValueError, "limit"),
    ((3,), {}, TypeError, "conf: expected"),
    ((CONF,), {"frameworks": ["jax"]}, ValueError, "'jax' is not one mempool can hook"),
    ((CONF,), {"frameworks": 3}, TypeError, "frameworks: expected"),
    ((CONF,), {"prometheus": "yes"}, TypeError, "prometheus must be True or False"),
    ((CONF,), {"frameworks": ["cupy"]}, ValueError, "a 'sim' pool cannot serve CUDA"),
    (("backend:host",), {"frameworks": "numba"}, ValueError, "a 'host' pool cannot serve"),
])
def test_bad_plugin_arguments_fail_on_the_client(args, kwargs, error, words):
    with pytest.raises(error, match=words):
        md.MempoolPlugin(*args, **kwargs)


def test_each_worker_builds_its_pool_after_start(client):
    _register(client)
    infos = md.gather(client)
    assert len(infos) == 2
    assert len({i["pid"] for i in infos.values()}) == 2            # two processes
    for info in infos.values():
        assert (info["backend"], info["device"], info["conf"]) == ("sim", 0, CONF)
        assert info["stats"]["allocation.all.current"] == 0
        assert set(info["hooks"]) == {"cupy", "torch", "numba"}   # none on a sim pool
        assert all(v.startswith("skipped") for v in info["hooks"].values())
    limits = client.run(lambda: md.worker_pool().options["limit"])
    assert set(limits.values()) == {64 * MiB}


def test_tasks_allocate_from_their_workers_pool_and_the_report_adds_them_up(client):
    _register(client)
    a, b = sorted(client.scheduler_info()["workers"])
    futures = [client.submit(_hold, MiB, workers=[a], pure=False),
               client.submit(_hold, 4 * MiB, workers=[b], pure=False)]
    distributed.wait(futures, timeout=TASK_TIMEOUT)
    assert all(f.status == "finished" for f in futures), futures
    infos = md.gather(client)
    assert infos[a]["used_bytes"] == MiB and infos[b]["used_bytes"] == 4 * MiB
    assert infos[a]["stats"]["allocation.all.allocated"] == 1
    text = md.report(client)
    assert text.startswith("mempool on 2 Dask worker(s)")
    assert f"{a} (pid {infos[a]['pid']}): sim device 0, reserved 2.00 MiB, used 1.00 MiB" in text
    assert f"{b} (pid {infos[b]['pid']}): sim device 0, reserved 20.00 MiB, used 4.00 MiB" in text
    assert "total: reserved 22.00 MiB, used 5.00 MiB, cached 17.00 MiB, OOMs 0" in text
    assert text.count("memory summary, sim device 0") == 2            # each worker's summary


def test_a_worker_over_its_limit_gets_the_pools_error(client):
    _register(client)
    a, b = sorted(client.scheduler_info()["workers"])
    message = client.submit(_overflow, 100 * MiB, workers=[a],
                            pure=False).result(timeout=TASK_TIMEOUT)
    assert "limit of 64.00 MiB" in message
    held = client.submit(_hold, 8 * MiB, workers=[b], pure=False)
    assert held.result(timeout=TASK_TIMEOUT) > 0
    infos = md.gather(client)
    assert infos[a]["stats"]["num_ooms"] == 1 and infos[b]["stats"]["num_ooms"] == 0
    assert "OOMs 1" in md.report(client)


def _pool_number():
    """The worker pool's creation number in its process (an id() may be reused)."""
    return [n for n, p in mempool.live_pools() if p is md.worker_pool()][0]


def test_registering_again_replaces_the_pool(client):
    _register(client)
    first = client.run(_pool_number)
    _register(client, "backend:sim,capacity:1GiB,limit:32MiB")
    assert set(client.run(lambda: md.worker_pool().options["limit"]).values()) == {32 * MiB}
    again = client.run(_pool_number)
    assert all(again[w] > first[w] for w in first)
    # The new pool is the worker's default pool too.
    assert set(client.run(lambda: mempool.default_pool() is md.worker_pool()).values()) == {True}


def test_frameworks_a_workers_pool_cannot_serve_fail_its_setup(client):
    # No backend in the conf: each worker picks (sim here, without a GPU), so the refusal
    # comes from the workers. distributed tears the old plugin down before the new one's
    # setup, so the workers are left without a pool until a good plugin is registered.
    _register(client)
    with pytest.raises(ValueError, match="a 'sim' pool cannot serve CUDA frameworks"):
        client.register_plugin(md.MempoolPlugin("capacity:1GiB", frameworks=["cupy"]))
    assert all(i["pool"] is None for i in md.gather(client).values())
    _register(client)
    assert all(i["backend"] == "sim" for i in md.gather(client).values())


def test_unregistering_tears_the_pool_down(client):
    _register(client)
    client.unregister_worker_plugin("mempool")
    infos = md.gather(client)
    assert all(i["pool"] is None for i in infos.values())
    assert "no pool (MempoolPlugin not run)" in md.report(client)
    _register(client)


def test_a_restarted_worker_builds_its_pool_again(client):
    _register(client, "backend:sim,capacity:1GiB,limit:48MiB")
    before = md.gather(client)
    victim = sorted(before)[0]
    started = time.monotonic()
    client.restart_workers([victim])
    client.wait_for_workers(2, timeout=30)
    after = md.gather(client)
    assert time.monotonic() - started < 30
    assert len(after) == 2
    assert {i["pid"] for i in after.values()} != {i["pid"] for i in before.values()}
    for info in after.values():
        assert info["pool"] is not None and info["stats"]["allocation.all.allocated"] == 0
    assert set(client.run(lambda: md.worker_pool().options["limit"]).values()) == {48 * MiB}


def test_one_endpoint_serves_every_workers_metrics(client):
    pytest.importorskip("prometheus_client", reason="pip install prometheus-client")
    from prometheus_client.parser import text_string_to_metric_families

    from _support import fetch_text
    _register(client)
    a, b = sorted(client.scheduler_info()["workers"])
    client.submit(_hold, 2 * MiB, workers=[b], pure=False).result(timeout=TASK_TIMEOUT)
    with md.serve_metrics(client, port=0, labels={"cluster": "test"}) as server:
        assert server.url.startswith("http://127.0.0.1:")
        text = fetch_text(server.url, timeout=10)
    used = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "mempool_allocated_bytes":
                assert s.labels["cluster"] == "test" and s.labels["backend"] == "sim"
                used[s.labels["worker"]] = s.value
    assert used == {a: 0, b: 2 * MiB}


def test_the_plugin_adds_metrics_to_each_workers_registry(client):
    pytest.importorskip("prometheus_client", reason="pip install prometheus-client")

    def scrape_registry(dask_worker):
        import prometheus_client
        return prometheus_client.generate_latest().decode()

    _register(client, prometheus=True)
    texts = client.run(scrape_registry)
    for address, text in texts.items():
        assert 'mempool_limit_bytes{backend="sim",device="0",pool=' in text
        assert f'worker="{address}"' in text
    _register(client)                                  # replaced: the collector goes
    for text in client.run(scrape_registry).values():
        assert "mempool_limit_bytes" not in text


def test_worker_pool_outside_a_plugin_says_what_to_do():
    with pytest.raises(RuntimeError, match="register mempool.dask.MempoolPlugin"):
        md.worker_pool()


def test_client_support_refuse_what_is_not_a_client():
    with pytest.raises(TypeError, match="distributed.Client"):
        md.gather("tcp://127.0.0.1:8786")
    with pytest.raises(TypeError, match="distributed.Client"):
        md.serve_metrics(None, port=0)
