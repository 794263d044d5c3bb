"""One pool per Dask worker: a ``distributed`` worker plugin, a cluster-wide report, and
the workers' metrics on one Prometheus endpoint.

    from distributed import Client, LocalCluster      # or dask_cuda.LocalCUDACluster
    import mempool.dask

    client = Client(LocalCUDACluster())
    client.register_plugin(mempool.dask.MempoolPlugin("release_threshold:4GiB,limit:0.9"))
    ...
    print(mempool.dask.report(client))                 # every worker's pool, one report

The plugin builds each worker's pool from a conf string in the ``MEMPOOL_CONF`` syntax
(``Pool.from_conf``) on the worker's GPU: device 0 unless the conf names one, which under
dask-cuda (one worker per GPU, ``CUDA_VISIBLE_DEVICES`` rotated per worker) is the worker's
own GPU. Without a ``backend`` key the pool is ``cuda`` when the worker sees a GPU and
``sim`` otherwise. The pool becomes the worker's ``mempool.default_pool(device)``, so tasks
reach it with :func:`worker_pool` or ``mempool.default_pool()``. On a ``cuda`` pool it hooks
CuPy (``mempool.cupy.set_allocator``), PyTorch (``mempool.torch.install``, possible only
before PyTorch initialises CUDA in the worker) and Numba (``mempool.numba.install``), each
only if importable in the worker (``frameworks="auto"``) or as listed. Registered after the
workers started, it applies to them at once; the scheduler gives it to every worker that
joins later, so a restarted worker builds its pool again. Registering it again replaces it
(the old pool is unhooked first).

This module imports ``distributed`` only when used.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mempool._core import Pool
    from mempool.prometheus import MetricsServer

__all__ = ["MempoolPlugin", "FRAMEWORKS", "worker_pool", "gather", "report", "serve_metrics"]

_INSTALL_HINT = "mempool.dask needs Dask's distributed scheduler (pip install distributed)"

#: The frameworks the plugin can hook, in the order it hooks them.
FRAMEWORKS = ("cupy", "torch", "numba")

# The state of this worker process: guarded by _state_lock. "pool", "conf", "device",
# "hooks" ({framework: what happened}), "collector" (a Prometheus collector or None).
_state = {}
_state_lock = threading.Lock()
_plugin_class = None


def _distributed():
    from mempool._optional import require
    return require("distributed", _INSTALL_HINT)


def __getattr__(name: str) -> Any:
    # The plugin must subclass distributed.WorkerPlugin (Client.register_plugin dispatches on
    # the type), so the class is built on first use; `import mempool.dask` needs no Dask.
    if name == "MempoolPlugin":
        return _build_plugin_class()
    raise AttributeError(f"module 'mempool.dask' has no attribute {name!r}")


def _check_frameworks(frameworks):
    if frameworks == "auto":
        return "auto"
    if isinstance(frameworks, str):
        frameworks = [frameworks]
    try:
        names = list(frameworks)
    except TypeError:
        raise TypeError(f"frameworks: expected 'auto' or a list of names from {FRAMEWORKS}, "
                        f"got {type(frameworks).__name__}") from None
    for name in names:
        if name not in FRAMEWORKS:
            raise ValueError(f"frameworks: {name!r} is not one mempool can hook; accepted: "
                             f"'auto', or names from {FRAMEWORKS}")
    return tuple(n for n in FRAMEWORKS if n in names)


def _pool_options(conf):
    """The pool options of `conf`, checked (ValueError naming the key)."""
    from mempool import _config
    if not isinstance(conf, str):
        raise TypeError(f"conf: expected a MEMPOOL_CONF-style string (\"key:value,...\"), got "
                        f"{type(conf).__name__}")
    options = _config.parse_conf(conf, source="MempoolPlugin conf")
    _config.normalize(options)            # values checked on the client, not on every worker
    return options


def _importable(name):
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _check_hooks(pool, frameworks):
    """Refuse a list of frameworks that `pool` cannot serve in this worker, before the
    worker's current pool and hooks are touched."""
    if frameworks == "auto" or not frameworks:
        return
    if pool.backend != "cuda":
        raise ValueError(f"frameworks {list(frameworks)}: a {pool.backend!r} pool cannot serve "
                         f"CUDA frameworks; use backend:cuda, or frameworks=()")
    for name in frameworks:
        if not _importable(name):
            raise ImportError(f"frameworks: {name} is not installed in this worker")


def _hook(pool, frameworks):
    """Route the frameworks' allocations to `pool`; {framework: what happened}. A listed
    framework that refuses raises (after _check_hooks, only a refusal at run time, such as
    PyTorch's allocator already in use); with "auto" it is skipped, and said so."""
    explicit = frameworks != "auto"
    wanted = frameworks if explicit else FRAMEWORKS
    hooks = {}
    if pool.backend != "cuda":
        return {name: f"skipped: the pool's backend is {pool.backend!r}" for name in wanted}
    for name in wanted:
        if not _importable(name):
            hooks[name] = "skipped: not installed"
            continue
        try:
            if name == "cupy":
                import mempool.cupy
                mempool.cupy.set_allocator(pool)
            elif name == "torch":
                import mempool.torch
                mempool.torch.install(pool)
            else:
                import mempool.numba
                mempool.numba.install(pool)
        except (RuntimeError, ImportError) as exc:
            if explicit:
                _unhook(hooks)
                raise
            hooks[name] = f"skipped: {exc}"
            continue
        hooks[name] = "hooked"
    return hooks


def _unhook(hooks):
    # CuPy's allocator can be given back. PyTorch's is fixed for the process once installed
    # (a later pool on the same device is refused there, and said so in the hooks); Numba's
    # manager stays, and the next install points it at the new pool. Blocks handed out
    # go back to the pool they came from, which lives while they do.
    if hooks.get("cupy") == "hooked":
        import mempool.cupy
        mempool.cupy.set_allocator(None)


def _setup(conf, frameworks, prometheus, worker_address):
    import mempool
    from mempool import _cuda
    options = _pool_options(conf)
    options.setdefault("backend", "cuda" if _cuda.available() else "sim")
    device = options.setdefault("device", 0)
    pool = mempool.Pool(**options)
    _check_hooks(pool, frameworks)
    with _state_lock:
        _teardown_locked()
        hooks = _hook(pool, frameworks)
        with mempool._default_lock:
            mempool._default_pools[pool.device_id] = pool
        collector = None
        if prometheus:
            import mempool.prometheus
            collector = mempool.prometheus.register(pools=[pool],
                                                    labels={"worker": worker_address})
        _state.update(pool=pool, conf=conf, device=device, hooks=hooks, collector=collector,
                      worker=worker_address)
    return pool


def _teardown_locked():
    """Undo this worker's plugin (the caller holds _state_lock)."""
    if not _state:
        return
    _unhook(_state["hooks"])
    if _state["collector"] is not None:
        import prometheus_client
        prometheus_client.REGISTRY.unregister(_state["collector"])
    import mempool
    with mempool._default_lock:
        if mempool._default_pools.get(_state["pool"].device_id) is _state["pool"]:
            del mempool._default_pools[_state["pool"].device_id]
    _state.clear()


def _build_plugin_class():
    global _plugin_class
    if _plugin_class is not None:
        return _plugin_class
    distributed = _distributed()

    class MempoolPlugin(distributed.WorkerPlugin):
        """Build each worker's pool from `conf` and hook the worker's frameworks to it.

        Parameters
        ----------
        conf : str
            Pool options in the ``MEMPOOL_CONF`` syntax (``"backend:sim,limit:2GiB"``);
            checked when the plugin is made, so a bad key fails on the client.
        frameworks : "auto" or list of str
            ``"auto"``: hook each of CuPy, PyTorch and Numba importable in the worker (a
            ``sim`` or ``host`` pool hooks none). A list (``["cupy"]``, ``[]``) hooks exactly
            those and fails the worker's setup when one cannot be hooked.
        prometheus : bool
            Add the pool's metrics (labelled ``worker``) to the worker process's Prometheus
            registry, which the worker's dashboard serves at ``/metrics``.
        """

        name = "mempool"

        def __init__(self, conf="", frameworks="auto", prometheus=False):
            backend = _pool_options(conf).get("backend")
            self.conf = conf
            self.frameworks = _check_frameworks(frameworks)
            if backend in ("sim", "host") and self.frameworks not in ("auto", ()):
                raise ValueError(f"frameworks {list(self.frameworks)}: a {backend!r} pool "
                                 f"cannot serve CUDA frameworks; use backend:cuda, or "
                                 f"frameworks=()")
            if not isinstance(prometheus, bool):
                raise TypeError(f"prometheus must be True or False, got {prometheus!r}")
            if prometheus:
                import mempool.prometheus
                mempool.prometheus._prometheus()     # missing package: said on the client
            self.prometheus = prometheus

        def setup(self, worker):
            _setup(self.conf, self.frameworks, self.prometheus, worker.address)

        def teardown(self, worker):
            with _state_lock:
                _teardown_locked()

        def __repr__(self):
            return (f"MempoolPlugin(conf={self.conf!r}, frameworks={self.frameworks!r}, "
                    f"prometheus={self.prometheus!r})")

    # Pickled by reference (mempool.dask.MempoolPlugin) when sent to the workers.
    MempoolPlugin.__module__, MempoolPlugin.__qualname__ = __name__, "MempoolPlugin"
    _plugin_class = MempoolPlugin
    globals()["MempoolPlugin"] = MempoolPlugin
    return MempoolPlugin


# ------------------------------------------------------------------ in the worker


def worker_pool() -> Pool:
    """This worker's pool (in a task). RuntimeError where no MempoolPlugin has run."""
    with _state_lock:
        pool = _state.get("pool")
    if pool is None:
        raise RuntimeError("worker_pool: no mempool pool in this process; register "
                           "mempool.dask.MempoolPlugin(conf) with the client first")
    return pool


def _worker_info(dask_worker=None):
    """What the client gathers of one worker (run there by Client.run)."""
    import os
    with _state_lock:
        state = dict(_state)
    if not state:
        return {"pid": os.getpid(), "pool": None}
    pool = state["pool"]
    return {"pid": os.getpid(), "pool": repr(pool), "backend": pool.backend,
            "device": pool.device_id, "conf": state["conf"], "hooks": state["hooks"],
            "stats": pool.stats(), "summary": pool.summary(),
            "reserved_bytes": pool.reserved_bytes(), "used_bytes": pool.used_bytes(),
            "cached_bytes": pool.cached_bytes()}


def _worker_samples(dask_worker=None):
    import mempool.prometheus
    with _state_lock:
        pool = _state.get("pool")
    return [] if pool is None else mempool.prometheus.samples([pool])


# ------------------------------------------------------------------ on the client


def _check_client(client):
    distributed = _distributed()
    if not isinstance(client, distributed.Client):
        raise TypeError(f"client: expected a distributed.Client, got {type(client).__name__}")


def gather(client: Any) -> dict[str, Any]:
    """Every worker's pool, ``{worker address: info}``, where info holds ``pid``,
    ``backend``, ``device``, ``conf``, ``hooks`` (what each framework's hook did),
    ``stats`` (``Pool.stats()``), ``summary`` (``Pool.summary()``) and the reserved, used
    and cached bytes; ``{"pid": ..., "pool": None}`` for a worker without the plugin."""
    _check_client(client)
    return dict(sorted(client.run(_worker_info).items()))


def report(client: Any) -> str:
    """One text report of every worker's pool: a line per worker, the cluster's totals,
    then each worker's ``summary()``."""
    from mempool._units import format_bytes as size
    infos = gather(client)

    lines = [f"mempool on {len(infos)} Dask worker(s)"]
    total = {"reserved_bytes": 0, "used_bytes": 0, "cached_bytes": 0, "num_ooms": 0}
    for address, info in infos.items():
        if info["pool"] is None:
            lines.append(f"  {address} (pid {info['pid']}): no pool (MempoolPlugin not run)")
            continue
        hooks = ", ".join(f"{k} {v}" for k, v in info["hooks"].items()) or "none"
        ooms = info["stats"]["num_ooms"]
        lines.append(f"  {address} (pid {info['pid']}): {info['backend']} device "
                     f"{info['device']}, reserved {size(info['reserved_bytes'])}, used "
                     f"{size(info['used_bytes'])}, cached {size(info['cached_bytes'])}, "
                     f"OOMs {ooms}; hooks: {hooks}")
        for key in ("reserved_bytes", "used_bytes", "cached_bytes"):
            total[key] += info[key]
        total["num_ooms"] += ooms
    lines.append(f"  total: reserved {size(total['reserved_bytes'])}, used "
                 f"{size(total['used_bytes'])}, cached {size(total['cached_bytes'])}, OOMs "
                 f"{total['num_ooms']}")
    for address, info in infos.items():
        if info["pool"] is not None:
            lines += ["", f"== {address}", info["summary"]]
    return "\n".join(lines)


class _ClusterCollector:
    """Every worker's pool metrics at each scrape, labelled by worker (run on the client).
    A worker that fails to answer is left out of that scrape."""

    def __init__(self, client, labels):
        self._client = client
        self._labels = labels

    def collect(self):
        import mempool.prometheus
        answers = self._client.run(_worker_samples, on_error="return")
        samples = []
        for address, worker_samples in sorted(answers.items()):
            if isinstance(worker_samples, BaseException):
                continue
            for s in worker_samples:
                s["extra"] = {"worker": address}
                samples.append(s)
        if not samples:
            return mempool.prometheus.families([], dict(self._labels, worker=""))
        return mempool.prometheus.families(samples, self._labels)

    def describe(self):
        return []


def serve_metrics(client: Any, port: int = 9400, addr: str = "127.0.0.1",
                  labels: dict[str, str] | None = None) -> MetricsServer:
    """Serve every worker's pool metrics on one endpoint, ``http://addr:port/metrics``, from
    this (the client's) process: each scrape asks the workers (``Client.run``), and every
    series carries a ``worker`` label. Returns a ``mempool.prometheus.MetricsServer``."""
    import mempool.prometheus
    _check_client(client)
    labels = mempool.prometheus._check_labels(labels)
    if "worker" in labels:
        raise ValueError("labels: 'worker' is set for each worker already; accepted: any "
                         "other name")
    return mempool.prometheus.serve(port, addr, collector=_ClusterCollector(client, labels))
