"""Prometheus metrics of every pool: a collector for ``prometheus_client``, and one call to
serve them.

    import mempool.prometheus
    server = mempool.prometheus.serve(9400)        # http://127.0.0.1:9400/metrics
    ...
    server.close()

Each live pool of the process (``mempool.live_pools()``, held weakly: a pool the program
drops leaves the metrics) is one series per metric, labelled ``device``, ``backend`` and
``pool`` (its creation number in the process), plus any constant labels given:

=====================================  ======  ============================================
metric                                 type    value
=====================================  ======  ============================================
mempool_reserved_bytes                 gauge   held from the device (``reserved_bytes()``)
mempool_allocated_bytes                gauge   in live blocks (``used_bytes()``)
mempool_cached_bytes                   gauge   reserved, in no live block (``cached_bytes()``)
mempool_reserved_bytes_peak            gauge   ``reserved_bytes.all.peak``
mempool_allocated_bytes_peak           gauge   ``allocated_bytes.all.peak``
mempool_reserved_per_allocated_ratio   gauge   reserved / allocated (fragmentation and
                                               cache; absent while nothing is allocated)
mempool_largest_free_block_bytes       gauge   the largest block a request could take whole
mempool_limit_bytes                    gauge   the pool's ``limit`` (absent when unlimited)
mempool_capacity_bytes                 gauge   the device's capacity as the pool sees it
mempool_allocations_total              counter allocations served
mempool_ooms_total                     counter requests refused (``num_ooms``)
mempool_alloc_retries_total            counter allocations that needed the fallback chain
mempool_upstream_allocs_total          counter segment allocations from the upstream
mempool_upstream_frees_total           counter segment frees to the upstream
mempool_syncs_total                    counter stream synchronizations the pool made
=====================================  ======  ============================================

Counters restart from 0 after ``reset_accumulated_stats()``, which Prometheus reads as a
counter reset. ``mempool.dask.serve_metrics`` exports the same for every worker of a Dask
cluster, with a ``worker`` label. This module imports ``prometheus_client`` only when used.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mempool._core import Pool

__all__ = ["MempoolCollector", "samples", "families", "register", "serve", "MetricsServer"]

_INSTALL_HINT = "mempool.prometheus needs prometheus_client (pip install prometheus-client)"

# (name, type, help, key of a sample)
_METRICS = (
    ("mempool_reserved_bytes", "gauge", "Bytes the pool holds from the device.", "reserved"),
    ("mempool_allocated_bytes", "gauge", "Bytes in live blocks.", "allocated"),
    ("mempool_cached_bytes", "gauge", "Reserved bytes in no live block.", "cached"),
    ("mempool_reserved_bytes_peak", "gauge", "Peak reserved bytes.", "reserved_peak"),
    ("mempool_allocated_bytes_peak", "gauge", "Peak bytes in live blocks.", "allocated_peak"),
    ("mempool_reserved_per_allocated_ratio", "gauge",
     "Reserved bytes per allocated byte (absent while nothing is allocated).", "ratio"),
    ("mempool_largest_free_block_bytes", "gauge", "Largest free block.", "largest_free_block"),
    ("mempool_limit_bytes", "gauge", "The pool's limit (absent when unlimited).", "limit"),
    ("mempool_capacity_bytes", "gauge", "Device capacity as the pool sees it.", "capacity"),
    ("mempool_allocations", "counter", "Allocations served.", "allocations"),
    ("mempool_ooms", "counter", "Allocations refused for want of memory.", "ooms"),
    ("mempool_alloc_retries", "counter", "Allocations that needed the fallback chain.",
     "alloc_retries"),
    ("mempool_upstream_allocs", "counter", "Segment allocations from the upstream.",
     "upstream_allocs"),
    ("mempool_upstream_frees", "counter", "Segment frees to the upstream.", "upstream_frees"),
    ("mempool_syncs", "counter", "Stream synchronizations made by the pool.", "syncs"),
)
_POOL_LABELS = ("device", "backend", "pool")


def _prometheus():
    from mempool._optional import require
    return require("prometheus_client", _INSTALL_HINT)


def _check_pools(pools):
    from mempool import Pool
    if isinstance(pools, Pool):
        pools = [pools]
    try:
        pools = list(pools)
    except TypeError:
        raise TypeError(f"pools: expected mempool.Pool objects (a list), got "
                        f"{type(pools).__name__}") from None
    for i, pool in enumerate(pools):
        if not isinstance(pool, Pool):
            raise TypeError(f"pools[{i}]: expected a mempool.Pool, got {type(pool).__name__}")
    return pools


def _check_labels(labels):
    if labels is None:
        return {}
    if not hasattr(labels, "items"):
        raise TypeError(f"labels: expected a dict of label name -> value, got "
                        f"{type(labels).__name__}")
    out = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("__"):
            raise ValueError(f"labels: {key!r} is not a Prometheus label name (letters, "
                             f"digits and _, not starting with a digit or __)")
        if key in _POOL_LABELS:
            raise ValueError(f"labels: {key!r} is set for each pool already; accepted: any "
                             f"other name")
        out[key] = str(value)
    return out


def samples(pools: Pool | Iterable[Pool] | None = None) -> list[dict[str, Any]]:
    """One plain dict per pool (every live pool when `pools` is None): the values the
    metrics export, with the pool's labels. Picklable, so a Dask worker can send them."""
    import mempool
    if pools is None:
        numbered = mempool.live_pools()
    else:
        pools = _check_pools(pools)
        number = {id(p): n for n, p in mempool.live_pools()}
        numbered = [(number.get(id(p), -1), p) for p in pools]
    out = []
    for n, pool in numbered:
        if pool.closed:   # it holds nothing, and answers no call
            continue
        st = pool.stats()
        reserved, allocated = pool.reserved_bytes(), pool.used_bytes()
        out.append({
            "labels": {"device": str(pool.device_id), "backend": pool.backend, "pool": str(n)},
            "reserved": reserved,
            "allocated": allocated,
            "cached": pool.cached_bytes(),
            "reserved_peak": st["reserved_bytes.all.peak"],
            "allocated_peak": st["allocated_bytes.all.peak"],
            "ratio": reserved / allocated if allocated else None,
            "largest_free_block": pool.largest_free_block(),
            "limit": pool.options["limit"],
            "capacity": pool.capacity,
            "allocations": st["allocation.all.allocated"],
            "ooms": st["num_ooms"],
            "alloc_retries": st["num_alloc_retries"],
            "upstream_allocs": st["num_device_alloc"],
            "upstream_frees": st["num_device_free"],
            "syncs": st["num_sync_all_streams"],
        })
    return out


def families(pool_samples: list[dict[str, Any]],
             labels: dict[str, str] | None = None) -> list[Any]:
    """The metric families of `pool_samples` (from :func:`samples`), each sample's labels
    extended by the constant `labels` and by its own ``"extra"`` labels if it has them."""
    _prometheus()
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    labels = _check_labels(labels)
    rows = []
    names = None
    for s in pool_samples:
        row = dict(labels)
        row.update(s.get("extra", {}))
        row.update(s["labels"])
        if names is None:
            names = list(row)
        elif list(row) != names:
            raise ValueError(f"samples: every sample needs the same labels, got {names} and "
                             f"{list(row)}")
        rows.append((row, s))
    names = names or list(labels) + list(_POOL_LABELS)
    out = []
    for name, kind, doc, key in _METRICS:
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = cls(name, doc, labels=names)
        for row, s in rows:
            value = s[key]
            if value is not None:
                family.add_metric([row[n] for n in names], value)
        out.append(family)
    return out


class MempoolCollector:
    """A ``prometheus_client`` collector of pools' metrics.

    Parameters
    ----------
    pools : list of mempool.Pool, optional
        The pools to export; None (the default) exports every live pool at each scrape.
    labels : dict, optional
        Constant labels added to every series (``{"job": "trainer"}``).
    """

    def __init__(self, pools: Pool | Iterable[Pool] | None = None,
                 labels: dict[str, str] | None = None) -> None:
        _prometheus()
        self._pools = None if pools is None else _check_pools(pools)
        self._labels = _check_labels(labels)

    def collect(self) -> list[Any]:
        return families(samples(self._pools), self._labels)

    def describe(self):
        # Families without samples: prometheus_client checks names for clashes at
        # registration without running the pools' stats.
        return families([], self._labels)


def register(registry: Any = None, pools: Pool | Iterable[Pool] | None = None,
             labels: dict[str, str] | None = None) -> MempoolCollector:
    """Add a :class:`MempoolCollector` to `registry` (default: prometheus_client's global
    ``REGISTRY``, the one an application's own ``/metrics`` serves). Returns the collector
    (``registry.unregister(collector)`` removes it)."""
    prometheus_client = _prometheus()
    collector = MempoolCollector(pools, labels)
    (prometheus_client.REGISTRY if registry is None else registry).register(collector)
    return collector


class MetricsServer:
    """An HTTP server of ``/metrics`` in a daemon thread (what :func:`serve` returns).

    ``url`` is the address to scrape, ``port`` the port bound (useful with port 0);
    ``close()`` stops it (also as a context manager)."""

    def __init__(self, registry: Any, addr: str, port: int) -> None:
        from wsgiref.simple_server import WSGIRequestHandler
        prometheus_client = _prometheus()
        from prometheus_client.exposition import ThreadingWSGIServer

        class _Quiet(WSGIRequestHandler):
            def log_message(self, *args):       # no line on stderr per scrape
                pass

        app = prometheus_client.make_wsgi_app(registry)
        from wsgiref.simple_server import make_server
        self._httpd = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_Quiet)
        self.registry = registry
        self.addr = addr
        self.port = self._httpd.server_port
        host = f"[{addr}]" if ":" in addr else addr
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="mempool-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


def _check_port(port, addr):
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int in [0, 65535] (0: any free port), got "
                        f"{type(port).__name__} {port!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535] (0: any free port), got {port}")
    if not isinstance(addr, str) or not addr:
        raise TypeError(f"addr must be a host address string (default '127.0.0.1', "
                        f"loopback only), got {addr!r}")


def serve(port: int = 9400, addr: str = "127.0.0.1",
          pools: Pool | Iterable[Pool] | None = None, labels: dict[str, str] | None = None,
          collector: Any = None) -> MetricsServer:
    """Serve the pools' metrics at ``http://addr:port/metrics`` from a daemon thread.

    Parameters
    ----------
    port : int
        0 picks a free port (read it from the result's ``port``).
    addr : str
        The address bound: loopback by default, so nothing outside the machine can scrape
        until asked (``"0.0.0.0"`` for every interface).
    pools, labels
        As :class:`MempoolCollector`.
    collector : object, optional
        Serve this collector instead (``mempool.dask`` passes one over a cluster's
        workers).

    Returns
    -------
    MetricsServer
    """
    prometheus_client = _prometheus()
    _check_port(port, addr)
    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    registry.register(collector if collector is not None else MempoolCollector(pools, labels))
    return MetricsServer(registry, addr, port)
