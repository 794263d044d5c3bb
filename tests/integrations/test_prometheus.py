"""mempool.prometheus: pools' metrics scraped from the endpoint on loopback."""
import gc
import urllib.request

import pytest

import mempool
from _support import fetch_text

MiB = 1 << 20

prometheus_client = pytest.importorskip("prometheus_client",
                                        reason="pip install prometheus-client")
import mempool.prometheus as mprom                          # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def scrape(url):
    """The endpoint's metrics as {(name, labels...): value}."""
    out = {}
    for family in text_string_to_metric_families(fetch_text(url)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(metrics, name, **labels):
    return {key: v for key, v in metrics.items()
            if key[0] == name and all((k, v2) in key[1] for k, v2 in labels.items())}


def value(metrics, name, pool):
    (v,) = series(metrics, name, pool=pool).values()
    return v


@pytest.fixture
def number():
    """The creation number of a pool (its `pool` label)."""
    def find(pool):
        (n,) = [n for n, p in mempool.live_pools() if p is pool]
        return str(n)
    return find


def test_every_metric_of_a_pool_with_exact_values(number):
    pool = mempool.Pool(backend="sim", capacity=1 << 30, limit=64 * MiB)
    a = pool.alloc(MiB)                          # a 2 MiB small segment, half of it live
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(100 * MiB)
    n = number(pool)
    with mprom.serve(0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        m = scrape(server.url)
    assert value(m, "mempool_reserved_bytes", n) == 2 * MiB
    assert value(m, "mempool_allocated_bytes", n) == MiB
    assert value(m, "mempool_cached_bytes", n) == MiB
    assert value(m, "mempool_reserved_bytes_peak", n) == 2 * MiB
    assert value(m, "mempool_allocated_bytes_peak", n) == MiB
    assert value(m, "mempool_reserved_per_allocated_ratio", n) == 2.0
    assert value(m, "mempool_largest_free_block_bytes", n) == MiB
    assert value(m, "mempool_limit_bytes", n) == 64 * MiB
    assert value(m, "mempool_capacity_bytes", n) == 1 << 30
    assert value(m, "mempool_allocations_total", n) == 1
    assert value(m, "mempool_ooms_total", n) == 1
    assert value(m, "mempool_upstream_allocs_total", n) == 1
    assert value(m, "mempool_upstream_frees_total", n) == 0
    labels = dict(next(iter(series(m, "mempool_ooms_total", pool=n)))[1])
    assert labels == {"backend": "sim", "device": "0", "pool": n}
    pool.free(a)


def test_peaks_and_upstream_frees_follow_the_pool(number):
    pool = mempool.Pool(backend="sim", device=1, capacity=1 << 30)
    n = number(pool)
    with mprom.serve(0) as server:
        big = pool.alloc(30 * MiB)
        pool.free(big)
        pool.empty_cache()
        m = scrape(server.url)
        assert value(m, "mempool_allocated_bytes_peak", n) == 30 * MiB
        assert value(m, "mempool_reserved_bytes", n) == 0
        assert value(m, "mempool_upstream_frees_total", n) == 1
        # Nothing allocated: the ratio has no value, so its series is absent.
        assert series(m, "mempool_reserved_per_allocated_ratio", pool=n) == {}
        assert series(m, "mempool_limit_bytes", pool=n) == {}       # no limit
        assert dict(next(iter(series(m, "mempool_reserved_bytes", pool=n)))[1])["device"] == "1"


def test_a_dropped_pool_leaves_the_metrics(number):
    pool = mempool.Pool(backend="host", capacity=64 * MiB)
    n = number(pool)
    with mprom.serve(0) as server:
        assert series(scrape(server.url), "mempool_reserved_bytes", pool=n)
        del pool
        gc.collect()
        assert series(scrape(server.url), "mempool_reserved_bytes", pool=n) == {}


def test_given_pools_and_constant_labels(number):
    watched = mempool.Pool(backend="sim", capacity=1 << 30)
    other = mempool.Pool(backend="sim", capacity=1 << 30)
    with mprom.serve(0, pools=[watched], labels={"job": "trainer"}) as server:
        m = scrape(server.url)
    names = {dict(key[1])["pool"] for key in series(m, "mempool_reserved_bytes")}
    assert names == {number(watched)}
    assert {dict(key[1])["job"] for key in series(m, "mempool_reserved_bytes")} == {"trainer"}
    del other


def test_register_adds_to_an_applications_registry(number):
    pool = mempool.Pool(backend="sim", capacity=1 << 30)
    ptr = pool.alloc(4096)
    registry = prometheus_client.CollectorRegistry()
    collector = mprom.register(registry, pools=[pool])
    text = prometheus_client.generate_latest(registry).decode()
    expected = (f'mempool_allocated_bytes{{backend="sim",device="0",pool="{number(pool)}"}} '
                f'4096.0')
    assert expected in text
    registry.unregister(collector)
    assert "mempool_" not in prometheus_client.generate_latest(registry).decode()
    pool.free(ptr)


def test_the_server_binds_loopback_by_default_and_closes():
    server = mprom.serve(0)
    assert server._httpd.server_address[0] == "127.0.0.1"
    url = server.url
    scrape(url)
    server.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"port": True}, TypeError, "port must be an int"),
    ({"port": "9400"}, TypeError, "port must be an int"),
    ({"port": 70000}, ValueError, "port must be in"),
    ({"port": -1}, ValueError, "port must be in"),
    ({"port": 0, "addr": None}, TypeError, "addr must be"),
    ({"port": 0, "pools": ["x"]}, TypeError, "pools\\[0\\]: expected a mempool.Pool"),
    ({"port": 0, "pools": 3}, TypeError, "pools: expected"),
    ({"port": 0, "labels": {"1x": "a"}}, ValueError, "not a Prometheus label name"),
    ({"port": 0, "labels": {"device": "a"}}, ValueError, "set for each pool"),
    ({"port": 0, "labels": ["job"]}, TypeError, "labels: expected a dict"),
])
def test_bad_arguments_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        mprom.serve(**kwargs)
