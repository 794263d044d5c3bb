"""mempool: one stream-ordered GPU memory pool for CuPy, PyTorch and JAX.

>>> import mempool
>>> pool = mempool.Pool(backend="sim")          # "cuda" on a GPU, "host" for host memory
>>> ptr = pool.alloc(1 << 20)                   # on the current stream
>>> pool.free(ptr)

See README.md for the stream contract and docs/options.md for every option.
"""
import threading as _threading

from mempool._core import HostDevice, Pool, SimDevice, round_size, segment_size, stream_handle
from mempool._core import live_pools   # every live Pool, weakly (mempool.prometheus)
from mempool._core import Buffer   # sharing: Pool.empty's result (mempool/_buffer.pxi)
from mempool._core import SharedHandle   # Pool.export's result (mempool/_share.pxi)
from mempool._errors import InvariantError, OutOfMemoryError, PoolClosedError
from mempool._config import ConfigWarning   # a conf setting accepted but not applied
from mempool._config import OptionError   # an option's value that is not valid

__all__ = ["Pool", "Buffer", "SharedHandle", "OutOfMemoryError", "InvariantError", "PoolClosedError",
           "ConfigWarning", "OptionError",
           "default_pool", "round_size", "segment_size", "stream_handle", "SimDevice",
           "HostDevice", "live_pools"]
__version__ = "0.1.0"

_default_pools: dict[int, Pool] = {}
_default_lock = _threading.Lock()


def default_pool(device: int = 0) -> Pool:
    """The process-wide pool of ``device``, created on first use.

    Built from the ``MEMPOOL_CONF`` environment variable when set (the same syntax as
    ``Pool.from_conf``). Without a ``backend`` key it is ``cuda`` when a GPU is usable, and
    the simulated device otherwise. Once that pool is closed (:meth:`Pool.close`), the next
    call makes a fresh one.
    """
    from mempool import _config, _cuda
    # One pool per device ordinal: "1", True or 1.0 must not make a second pool for device 1.
    device = _config.OPTIONS["device"].parse(device, "device")
    with _default_lock:
        pool = _default_pools.get(device)
        if pool is None or pool.closed:
            options = _config.conf_from_env()
            options.setdefault("backend", "cuda" if _cuda.available() else "sim")
            options["device"] = device
            pool = _default_pools[device] = Pool(**options)
        return pool
