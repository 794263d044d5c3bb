"""The layers of the C data plane (docs/architecture.md, "Layers"), read from the source.

Each folder of mempool/_csrc is a layer: glue -> core -> upstream -> common, and testing
beside them. A file may use its own layer, the layer just below it and common; common uses
nothing of ours; testing (test and benchmark controls) may use anything, and nothing of the
product uses it. "Use" is an #include of one of our headers, or a call of a function (or
function-like macro) defined in another layer: the layer of a name is the folder of the file
that defines it (a non-static function of a .c/.cpp file, a static inline function or a
macro of a header). Across layers only a layer's public headers are included; its private
ones (the *_internal.h of a split module, the CUDA driver's hand-declared types) stay inside.

The Cython layer (.pyx/.pxd/.pxi, `cdef extern from "..."`) is the Python face of the whole
plane: it makes the pools (core), builds the upstreams they draw from and drives the test
controls of the simulated and host devices (upstream), hands blocks to DLPack and PyTorch
(glue) and runs the benchmark loops (testing). So it may name the public header of any
layer, and no private one.
"""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "mempool", "_csrc")
PACKAGE = os.path.join(ROOT, "mempool")

# What each layer may use besides itself.
BELOW = {
    "glue": {"core", "common"},
    "core": {"upstream", "common"},
    "upstream": {"common"},
    "common": set(),
    "testing": {"glue", "core", "upstream", "common"},
}
# The headers another layer (or the Cython layer) may include.
PUBLIC = {
    "common": {"mp_errors.h", "mp_ptrmap.h", "mp_assert.h", "mp_fdpass.h", "mp_proc.h"},
    "core": {"mp_core.h", "mp_size.h", "mp_share.h"},
    "upstream": {"mp_upstream.h", "mp_sim.h", "mp_cuda.h", "mp_budget.h"},
    "glue": {"mp_torch.h", "mp_dlpack.h", "torch_current_device.h"},
    "testing": {"mp_bench.h"},
}

SOURCE_SUFFIXES = (".c", ".h", ".cpp")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
MACRO = re.compile(r"^\s*#\s*define\s+(\w+)\(", re.M)
# A definition at column 0: return type, name, parameters, then the body's brace.
FUNCTION = re.compile(r"^(static\s+)?(?:inline\s+)?(?!return\b|else\b|typedef\b)[A-Za-z_][\w \t\*]*?"
                      r"\b(\w+)\s*\([^;{}]*\)\s*\{", re.M)
EXTERN = re.compile(r'^\s*cdef\s+extern\s+from\s+"([^"]+)"', re.M)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def strip_strings(text):
    return re.sub(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])\'', '""', text)


def sources():
    """(layer, path relative to _csrc, text, text without comments) of every C/C++ source."""
    out = []
    for layer in sorted(os.listdir(CSRC)):
        folder = os.path.join(CSRC, layer)
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith(SOURCE_SUFFIXES):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    raw = f.read()
                out.append((layer, f"{layer}/{name}", raw, strip_comments(raw)))
    return out


def definitions(files):
    """name -> {layers defining it}, and rel path -> the names the file defines itself."""
    where, own = {}, {}
    for layer, rel, raw, text in files:
        names = set()
        for m in FUNCTION.finditer(strip_strings(text)):
            static, name = m.group(1), m.group(2)
            names.add(name)
            if not static or rel.endswith(".h"):
                where.setdefault(name, set()).add(layer)
        for name in MACRO.findall(raw):
            names.add(name)
            if rel.endswith(".h"):
                where.setdefault(name, set()).add(layer)
        own[rel] = names
    return where, own


def header_layers(files):
    return {rel.split("/", 1)[1]: layer for layer, rel, _, _ in files if rel.endswith(".h")}


def breaches(files):
    """(rel, "include" | "call", name, why) for every use that skips a layer."""
    where, own = definitions(files)
    headers = header_layers(files)
    found = []
    for layer, rel, raw, text in files:
        allowed = BELOW[layer] | {layer}
        for name in INCLUDE.findall(text):
            home = headers.get(name)
            if home is None:
                continue   # not ours (a PyTorch or system header)
            if home not in allowed:
                found.append((rel, "include", name, f"{layer} may not include {home}'s {name}"))
            elif home != layer and name not in PUBLIC[home]:
                found.append((rel, "include", name, f"{name} is private to {home}"))
        for name in set(CALL.findall(strip_strings(text))) - own[rel]:
            homes = where.get(name)
            if homes and not homes & allowed:
                found.append((rel, "call", name,
                              f"{layer} may not call {name}, defined in {sorted(homes)}"))
    return found


def test_every_folder_is_a_layer_the_build_knows():
    folders = sorted(d for d in os.listdir(CSRC) if os.path.isdir(os.path.join(CSRC, d)))
    assert set(folders) == set(BELOW), folders
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        layers = re.search(r"^LAYERS = \(([^)]*)\)", f.read(), re.M).group(1)
    assert set(re.findall(r'"(\w+)"', layers)) == set(BELOW)


def test_the_scan_sees_the_definitions_and_uses():
    """The reading itself: known definitions and a known use across layers are found, so that
    the tests below cannot pass by reading nothing."""
    files = sources()
    where, _ = definitions(files)
    assert where["mp_alloc"] == {"core"}
    assert where["mp_sim_upstream"] == {"upstream"}
    assert where["mp_ptrmap_get"] == {"common"}
    assert where["mp_check"] == {"common"}   # a macro of a header
    assert "cu_segment_alloc" not in where   # static in mp_cuda.c: no layer's to call
    # A made-up file of the upstream layer that calls the core is caught, by include and call.
    fake = ("upstream", "upstream/fake.c", "", '#include "mp_core.h"\nint f(void) { return mp_alloc(0); }\n')
    found = breaches(files + [fake])
    assert ("upstream/fake.c", "include", "mp_core.h") in {f[:3] for f in found}
    assert ("upstream/fake.c", "call", "mp_alloc") in {f[:3] for f in found}
    # A private header named across layers is caught too.
    fake = ("core", "core/fake.c", "", '#include "mp_sim_internal.h"\n')
    assert ("core/fake.c", "include", "mp_sim_internal.h") in {f[:3] for f in breaches(files + [fake])}


def test_no_include_or_call_skips_a_layer():
    found = breaches(sources())
    assert not found, "\n".join(f"{rel}: {why}" for rel, _, _, why in found)


def test_common_includes_nothing_of_ours_outside_it():
    for layer, rel, _, text in sources():
        if layer == "common":
            ours = [n for n in INCLUDE.findall(text) if n in header_layers(sources())]
            assert all(header_layers(sources())[n] == "common" for n in ours), (rel, ours)


def test_nothing_of_the_product_uses_testing():
    for layer, rel, _, text in sources():
        if layer != "testing":
            assert not set(INCLUDE.findall(text)) & PUBLIC["testing"], rel


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(PACKAGE)
                                        if n.endswith((".pyx", ".pxd", ".pxi"))))
def test_cython_names_only_public_headers(name):
    with open(os.path.join(PACKAGE, name), encoding="utf-8") as f:
        named = EXTERN.findall(f.read())
    headers = header_layers(sources())
    ours = [h for h in named if h in headers]
    private = [h for h in ours if h not in PUBLIC[headers[h]]]
    assert not private, f"{name} names private headers {private}"
