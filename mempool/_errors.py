"""The exceptions mempool raises."""


class OutOfMemoryError(MemoryError):
    """The device, or the pool's ``limit``, refused an allocation.

    The message names the request (and its rounded size), the pool's reserved, used and
    cached bytes, the limit or capacity that refused it, the largest free block, and the
    option most likely to help. The pool is unchanged and usable afterwards.
    """


class PoolClosedError(RuntimeError):
    """A call on a :class:`~mempool.Pool` after :meth:`~mempool.Pool.close`: a closed pool
    holds no memory and serves no call; make a new one."""


class InvariantError(AssertionError):
    """The pool's bookkeeping breached an invariant (a bug in mempool; please report it)."""


def require_open(pool, name):
    """Raise PoolClosedError naming argument `name` when the Pool `pool` is closed: for hooks
    that hold a pool and would otherwise fail only at their first allocation."""
    if pool.closed:
        raise PoolClosedError(f"{name}: the pool (backend {pool.backend!r}, device "
                              f"{pool.device_id}) is closed; make a new Pool")


def require_instance(value, cls, name):
    """Raise TypeError naming argument `name` unless `value` is a `cls` (a clear error
    instead of an AttributeError from deep inside a helper)."""
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected a mempool.{cls.__name__}, got "
                        f"{type(value).__name__} {value!r}"[:300])
