"""Importing an integration's framework when it is used, with one line on what to install."""
import importlib


def require(module, hint):
    """``import module``, or an ImportError that starts with `hint` (what to install) and
    says why the import failed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{hint}; importing {module} failed: {exc}") from None
