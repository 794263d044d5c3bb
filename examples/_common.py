"""Shared bits of the examples: picking a backend, checking what is installed, and printing
a pool's accounting."""
import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import Any

from mempool import Pool
from mempool._units import format_bytes


def gpu_available() -> bool:
    """True when backend="cuda" can run here: the Pool's own probe (never raises)."""
    from mempool import _cuda
    return _cuda.available()


def parse_backend(description: str, cpu_backend: str,
                  argv: list[str] | None = None) -> argparse.Namespace:
    """--backend cuda|<cpu_backend>; the default is cuda when there is a GPU."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--backend", choices=("cuda", cpu_backend),
                    default="cuda" if gpu_available() else cpu_backend)
    return ap.parse_args(argv)


def _example_name() -> str:
    return os.path.basename(sys.argv[0]) or "this example"


def _not_installed(error: BaseException, module: str) -> bool:
    """True when `error` says that `module` itself (or a package above it) is absent, rather
    than that it is installed and something it imports is missing or broken."""
    missing = getattr(error, "name", None)
    return (isinstance(error, ModuleNotFoundError) and missing is not None
            and (module == missing or module.startswith(missing + ".")))


def require(module: str, what: str, install: str) -> ModuleType:
    """Import `module`; without it, say in one line what to install and exit (status 0: the
    example does not apply to this machine, nothing failed). An installation that fails to
    import (a library missing under it, a NumPy it does not support) is said in one line too,
    with the error, and exits the same way."""
    try:
        return importlib.import_module(module)
    except Exception as error:   # noqa: BLE001 - any failure of a third-party import
        if _not_installed(error, module):
            print(f"{_example_name()}: skipped, it needs {what}, which is not installed here "
                  f"(pip install {install})")
        else:
            print(f"{_example_name()}: skipped, {what} is installed but `import {module}` "
                  f"fails here ({first_line(error)})")
        sys.exit(0)


def first_line(error: BaseException) -> str:
    """`error` in one line: its type and the first line of its message."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def numpy_names_for_numba() -> None:
    """Call before importing numba-cuda. Its 0.x releases register typing for np.row_stack,
    which NumPy 2.5 removed, so on such an installation `from numba import cuda` fails before
    any kernel is compiled; row_stack was always vstack under another name."""
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def size_text(nbytes: int) -> str:
    return f"{format_bytes(nbytes):>10}"


def report(pool: Pool, title: str) -> None:
    st = pool.stats()
    print(f"-- {title}")
    print(f"   used {size_text(pool.used_bytes())}  cached {size_text(pool.cached_bytes())}  "
          f"reserved {size_text(pool.reserved_bytes())}")
    print(f"   allocations {st['allocation.all.allocated']}, frees {st['allocation.all.freed']}, "
          f"peak allocated {size_text(st['allocated_bytes.all.peak'])}, "
          f"segments {st['segment.all.current']}")


def train_mlp(torch: Any, steps: int, batch: int, width: int, hidden: int) -> tuple[Any, Any]:
    """A few AdamW steps of a Linear-GELU-Linear MLP on random data (seed 0); returns the
    last loss and the last hidden activations (detached)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, width)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(batch, width, device="cuda")
        act = model[1](model[0](x))
        loss = model[2](act).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss, act.detach()
