"""The exceptions mempool raises."""


class OutOfMemoryError(MemoryError):
    """The device, or the pool's ``limit``, refused an allocation.

    The message names the request (and its rounded size), the pool's reserved, used and
    cached bytes, the limit or capacity that refused it, the largest free block, and the
    option most likely to help. The pool is unchanged and usable afterwards.
    """


class InvariantError(AssertionError):
    """The pool's bookkeeping breached an invariant (a bug in mempool; please report it)."""
