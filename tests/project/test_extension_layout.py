"""The compiled core's parts read as modules (mempool/_core.pyx): every C declaration in
_cdefs.pxd, and each include file uses only what the files included before it define, so no
helper calls back up into the Pool. A static check of the sources: it needs no build."""
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mempool")


def _read(name):
    with open(os.path.join(PACKAGE, name), encoding="utf-8") as f:
        return f.read()


def _parts():
    return re.findall(r'^include "(\w+\.pxi)"', _read("_core.pyx"), re.M)


def _code(text):
    """The source without docstrings, string literals and comments (what is executed)."""
    text = re.sub(r'"""[\s\S]*?"""', '""', text)
    text = re.sub(r"'''[\s\S]*?'''", "''", text)
    text = re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', text)
    text = re.sub(r"'(?:[^'\\\n]|\\.)*'", "''", text)
    return re.sub(r"#[^\n]*", "", text)


_DEFINITIONS = [
    r"^def (\w+)", r"^class (\w+)", r"^cdef class (\w+)", r"^cdef enum (\w+)",
    r"^DEF (\w+)", r"^(\w+)\s*=", r"^ctypedef [^\n]*?\b(\w+)\s*(?:\(|$)",
    # cdef functions and module variables: the last name before "(" or "=".
    r"^cdef (?!class|enum|extern)[^\n(=]*?\b(\w+)\s*[(=]",
    r"^    (_[A-Z]+)\s*=",          # members of a cdef enum
]


def _defined(code):
    names = set()
    for pattern in _DEFINITIONS:
        names.update(re.findall(pattern, code, re.M))
    return names


# The one name a part takes from a part after it: Pool.malloc hands a block to CuPy through
# _cupy_malloc, whose owner object holds a Pool, so one of the two names the other.
_LATER_NAMES = {("_pool.pxi", "_cupy_malloc")}


def test_the_parts_are_the_files_of_the_package():
    parts = _parts()
    on_disk = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".pxi"))
    assert sorted(parts) == on_disk
    assert parts.index("_pool.pxi") > max(parts.index(p) for p in (
        "_common.pxi", "_policy.pxi", "_cuda.pxi", "_streams.pxi", "_cudapool.pxi",
        "_peers.pxi", "_devices.pxi", "_buffer.pxi", "_pool_create.pxi", "_pool_errors.pxi",
        "_pool_retention.pxi", "_pool_observe.pxi"))
    assert parts.index("_cupy_hook.pxi") > parts.index("_pool.pxi")


@pytest.mark.parametrize("name", ["_core.pyx"] + [p for p in _parts()])
def test_no_c_declarations_outside_cdefs(name):
    assert "cdef extern" not in _code(_read(name)), f"{name} declares C: move it to _cdefs.pxd"


def test_each_part_uses_only_parts_included_before_it():
    parts = _parts()
    code = {p: _code(_read(p)) for p in parts}
    defined = {p: _defined(code[p]) for p in parts}
    assert {"Pool", "Buffer", "stream_handle", "_as_nbytes", "_make_device",
            "_enable_peer_access", "TRACE_ACTIONS", "_pool_create", "_pool_stats",
            "_give_back", "_oom_error", "_cupy_malloc"} <= set().union(*defined.values())
    later_uses = []
    for i, part in enumerate(parts):
        later = set().union(*(defined[p] for p in parts[i + 1:])) - defined[part]
        used = set(re.findall(r"\b\w+\b", code[part]))
        later_uses += [f"{part} uses {name}" for name in sorted(later & used)
                       if (part, name) not in _LATER_NAMES]
    assert later_uses == []


def test_the_one_later_name_is_still_used_and_defined_after():
    # A stale exception would let a real back-reference through unnoticed.
    parts = _parts()
    for part, name in _LATER_NAMES:
        (owner,) = [p for p in parts if name in _defined(_code(_read(p)))]
        assert parts.index(owner) > parts.index(part), (part, name, owner)
        assert re.search(rf"\b{name}\b", _code(_read(part))), (part, name)


def test_parts_cimport_what_they_use_themselves():
    # The Python C API calls a part makes are cimported by that part, not inherited from
    # one included earlier (as _pool.pxi once relied on _streams.pxi's PyErr_Clear).
    for part in _parts():
        code = _code(_read(part))
        for name in ("PyErr_Clear", "PyErr_Occurred", "PyCapsule_New", "PyCapsule_GetPointer",
                     "PyCapsule_IsValid", "memcpy", "c_free"):
            if re.search(rf"\b{name}\s*\(", code):
                assert re.search(rf"cimport [^\n]*\b{name}\b", code), (part, name)
