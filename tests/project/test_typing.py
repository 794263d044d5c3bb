"""Types and introspection: the compiled Pool's real signature, the stub of the compiled
module (mempool/_core.pyi) against the module itself, return annotations on the
integrations' public functions, the wheel's typing files, and ``mypy --strict examples/``."""
import ast
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

import mempool
from mempool import _core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = os.path.join(ROOT, "mempool", "_core.pyi")
INTEGRATIONS = ("cupy", "torch", "jax", "numba", "dask", "prometheus", "run")


def test_the_signature_of_pool_is_its_constructors():
    params = inspect.signature(mempool.Pool).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("backend", "cuda"), ("device", 0), ("capacity", None), ("options", inspect._empty)]
    assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
    assert mempool.Pool.__doc__.startswith("A stream-ordered device memory pool.")


def test_methods_have_their_real_signatures():
    assert str(inspect.signature(mempool.Pool.alloc)) == "(self, nbytes, stream=None)"
    assert "max_entries=100000" in str(inspect.signature(mempool.Pool.record_history))
    assert "(nbytes, roundup_power2_divisions=0)" == str(inspect.signature(mempool.round_size))


def _stub_classes():
    tree = ast.parse(open(STUB, encoding="utf-8").read())
    classes = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body
                                  if isinstance(n, ast.FunctionDef)} | \
                {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return classes, functions


@pytest.mark.parametrize("cls", [_core.Pool, _core.Buffer, _core.SimDevice, _core.HostDevice])
def test_the_stub_names_every_public_member(cls):
    classes, _ = _stub_classes()
    stubbed = set(classes[cls.__name__])
    for base in cls.__mro__[1:-1]:
        stubbed |= classes.get(base.__name__, set())
    public = {n for n in dir(cls) if not n.startswith("_")}
    assert public <= stubbed, f"missing from mempool/_core.pyi: {sorted(public - stubbed)}"


def test_the_stub_names_every_public_function_of_the_module():
    _, functions = _stub_classes()
    public = {n for n in dir(_core) if not n.startswith("_")
              and inspect.isroutine(getattr(_core, n))}
    assert public <= functions, f"missing from mempool/_core.pyi: {sorted(public - functions)}"


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_the_integrations_public_functions_have_return_annotations(name):
    module = importlib.import_module(f"mempool.{name}")
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    checked = 0
    for n in names:
        value = inspect.getattr_static(module, n, None)
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            assert "return" in value.__annotations__, f"mempool.{name}.{n}"
            checked += 1
    assert checked


def test_default_pool_is_annotated():
    assert mempool.default_pool.__annotations__["return"] in ("Pool", mempool.Pool)


def test_the_wheel_ships_the_typing_files():
    assert os.path.isfile(os.path.join(ROOT, "mempool", "py.typed")) and os.path.isfile(STUB)
    pyproject = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    package_data = pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert '"py.typed"' in package_data and '"*.pyi"' in package_data
    manifest = open(os.path.join(ROOT, "MANIFEST.in"), encoding="utf-8").read()
    assert "mempool/py.typed" in manifest and "mempool/*.pyi" in manifest


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="pip install mypy")
def test_the_examples_pass_mypy_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path), "examples/"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
