"""What the consumer processes of tests/core/test_share_processes.py run (started with
multiprocessing's "spawn": a function of an importable module, beside _support.py)."""
import os
import signal

import mempool


def read_and_write(handle_bytes, backend, value, answer):
    """Import the handle, check every byte is `value`, write `answer` over them, release;
    returns what it saw (first byte, length) or the error."""
    import numpy
    handle = mempool.SharedHandle.from_bytes(handle_bytes)
    pool = mempool.Pool(backend, capacity="64MiB")
    try:
        with pool.import_(handle) as buf:
            view = numpy.asarray(buf) if backend == "host" else None
            seen = (int(view[0]), int((view == value).sum())) if view is not None else \
                (None, buf.nbytes)
            if view is not None:
                view[:] = answer
                del view
        return ("ok", seen, pool.device.counters().get("open_imports"))
    except Exception as exc:   # reported to the parent, which asserts on it
        return ("error", f"{type(exc).__name__}: {exc}", None)
    finally:
        pool.close(force=True)


def hold_then_die(handle_bytes, backend, ready):
    """Import the handle, tell the parent, and die by SIGKILL without releasing."""
    handle = mempool.SharedHandle.from_bytes(handle_bytes)
    pool = mempool.Pool(backend, capacity="64MiB")
    buf = pool.import_(handle)
    ready.send(buf.nbytes)   # a pipe: sent before the call returns, unlike a Queue's thread
    os.kill(os.getpid(), signal.SIGKILL)


def import_bytes(handle_bytes, backend):
    """Import in a child: the error's type and message, or "ok"."""
    pool = mempool.Pool(backend, capacity="64MiB")
    try:
        pool.import_(mempool.SharedHandle.from_bytes(handle_bytes)).close()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        pool.close(force=True)
