"""pytest plugin: a test file of PyTorch's repository on a PyTorch release older than it.

    python -m pytest TEST_FILE -p own_tests_compat      (this folder on PYTHONPATH)

PyTorch's wheels do not ship their tests, so bench/torch_own_tests.py runs a test file from
PyTorch's repository, which may be newer than the installed release. Such a file imports
names from ``torch.testing._internal`` and friends that the release does not have yet (on
PyTorch 2.11, test_cuda.py of the main branch stopped at collection on
``TEST_CUDAMALLOCASYNC``), and then no test runs at all. Before the file is collected this
plugin reads its top-level ``from torch... import`` lines and gives each name the module
lacks a stand-in:

- capability flags (``TEST_*``, ``IS_*``, ``PLATFORM_SUPPORTS_*``): what they say on this
  machine where that is known (``TEST_CUDAMALLOCASYNC``: PyTorch runs on the driver's
  allocator), else False, as for a feature the release lacks;
- other constants (``MI300_ARCH``): None;
- skip decorators and precision switches (``skip*``, ``*_on_and_off``,
  ``recover_orig_fp32_precision``): decorators that change nothing, so their tests run;
- anything else: a function that raises NotImplementedError naming itself, so a test that
  calls it fails, under both allocators alike.

Both runs get the same stand-ins, so a test that differs between them still tells the
allocators apart. Each stand-in is printed, and written as JSON to the file named by
OWN_TESTS_COMPAT_REPORT. OWN_TESTS_COMPAT_PACKAGES names the top-level packages whose imports
are filled in (default "torch").
"""
import ast
import importlib
import importlib.util
import json
import os
import sys


def _allocator_is_cuda_malloc_async():
    try:
        import torch
        return bool(torch.cuda.is_available()
                    and torch.cuda.get_allocator_backend() == "cudaMallocAsync")
    except Exception:   # noqa: BLE001 -- no PyTorch, or no CUDA: the flag is False
        return False


# Flags whose meaning is known: computed on this machine rather than assumed False.
KNOWN_FLAGS = {
    "TEST_CUDAMALLOCASYNC": _allocator_is_cuda_malloc_async,
    "TEST_CUDA_PYTHON_BINDINGS": lambda: importlib.util.find_spec("cuda") is not None
    and importlib.util.find_spec("cuda.bindings") is not None,
}
FLAG_PREFIXES = ("TEST_", "IS_", "PLATFORM_SUPPORTS_")
PASSTHROUGH_NAMES = {"recover_orig_fp32_precision"}


def passthrough(*args, **kwargs):
    """A decorator that changes nothing, used bare (@name) or with arguments (@name(...))."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda f: f


def absent(module, name):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"{module}.{name} is not in the installed PyTorch")
    missing.__name__ = name
    return missing


def stand_in(module, name):
    """(value, how) for a name the module lacks."""
    if name in KNOWN_FLAGS:
        value = KNOWN_FLAGS[name]()
        return value, f"flag, {value} on this machine"
    if name.isupper():
        if name.startswith(FLAG_PREFIXES):
            return False, "flag, False (a feature the release lacks)"
        return None, "constant, None"
    if name.startswith("skip") or name.endswith("_on_and_off") or name in PASSTHROUGH_NAMES:
        return passthrough, "decorator that changes nothing"
    return absent(module, name), "raises NotImplementedError when called"


def packages():
    names = os.environ.get("OWN_TESTS_COMPAT_PACKAGES", "torch")
    return tuple(p.strip() for p in names.split(",") if p.strip())


def top_level_imports(path):
    """[(module, [names])] of the file's top-level ``from PACKAGE... import`` lines."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    wanted = packages()
    out = []
    for node in tree.body:
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.split(".")[0] in wanted):
            out.append((node.module, [a.name for a in node.names if a.name != "*"]))
    return out


def fill(path):
    """Give every name the file imports and its module lacks a stand-in. Returns the
    report: [{"module", "name", "stand_in"}], with "stand_in": None for a module that does
    not import at all (its line still stops the file)."""
    report = []
    for module_name, names in top_level_imports(path):
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            report.append({"module": module_name, "name": None, "stand_in": None,
                           "error": str(e)})
            continue
        for name in names:
            if hasattr(module, name):
                continue
            try:   # a submodule imported by name (from torch.cuda import memory)
                importlib.import_module(f"{module_name}.{name}")
                if hasattr(module, name):
                    continue
            except ImportError:
                pass
            value, how = stand_in(module_name, name)
            setattr(module, name, value)
            report.append({"module": module_name, "name": name, "stand_in": how})
    return report


def pytest_configure(config):
    report = {}
    for arg in config.args:
        path = arg.split("::", 1)[0]
        if path.endswith(".py") and os.path.isfile(path):
            report[path] = fill(path)
    for path, entries in report.items():
        for e in entries:
            if e["name"] is None:
                print(f"own_tests_compat: {path}: module {e['module']} does not import "
                      f"({e['error']})", file=sys.stderr)
            else:
                print(f"own_tests_compat: {path}: {e['module']}.{e['name']} is not in this "
                      f"release; stand-in: {e['stand_in']}", file=sys.stderr)
    out = os.environ.get("OWN_TESTS_COMPAT_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
