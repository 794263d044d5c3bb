"""Offline tools: what works on traces and snapshots, away from the allocation path.

``trace`` (record, save, load, import PyTorch's and RMM's), ``replay`` (a trace on a pool),
``tune`` (the settings that use least memory for a trace), ``report`` (PyTorch's summary and
snapshot formats) and ``plot`` (segment maps, memory over time). The command line's
``replay``, ``tune`` and ``plot`` (mempool/cli) are thin faces of these.

The tools lived at the package root before (``mempool.trace``, ``mempool.replay``, ...);
those names stay importable as the same module objects (:class:`_OldPaths`).
"""
import importlib
import importlib.abc
import importlib.util
import sys

TOOLS = ("trace", "replay", "tune", "report", "plot")


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import mempool.trace`` gives the module ``mempool.tools.trace`` itself (not a copy,
    so monkeypatching either name patches both), imported on first use as any module."""

    _MOVED = {f"mempool.{name}": f"mempool.tools.{name}" for name in TOOLS}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(self._MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # The import system has set the old name's spec on the module: it keeps its own.
        module.__spec__ = module.__spec__.loader_state


def _install_old_paths():
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
