"""The Python scripts that the GPU tests run in child processes (tests/_torch_scripts.py's
`run(body, prelude=...)`) compile: the CPU tier sees a script that a GPU run would only find
broken after the device's time was spent. Each script is the prelude followed by the
dedented body, as `run` joins them; a body that is a constant joined with an indented string
does not dedent, so such code belongs in the prelude. Formatted values of f-string bodies
stand in as `0`."""
import ast
import os
import textwrap

import pytest

import _torch_scripts

GPU_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu")


def text_of(node, names):
    """The string `node` builds from literals, f-strings and _torch_scripts' constants;
    None when it is built otherwise (a local variable, a call)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = [text_of(v, names) if isinstance(v, ast.Constant) else "0" for v in node.values]
        return "".join(parts)
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = text_of(node.left, names), text_of(node.right, names)
        return None if left is None or right is None else left + right
    return None


def scripts():
    names = {k: v for k, v in vars(_torch_scripts).items() if isinstance(v, str)}
    found = []
    for file in sorted(os.listdir(GPU_TESTS)):
        if not file.endswith(".py"):
            continue
        with open(os.path.join(GPU_TESTS, file)) as f:
            tree = ast.parse(f.read())
        if not any(isinstance(n, ast.ImportFrom) and n.module == "_torch_scripts"
                   and any(a.name == "run" for a in n.names) for n in ast.walk(tree)):
            continue   # its run(), if any, is another function
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "run" and call.args):
                continue
            body = text_of(call.args[0], names)
            prelude = _torch_scripts.PRELUDE
            for kw in call.keywords:
                if kw.arg == "prelude":
                    prelude = text_of(kw.value, names)
            if body is not None and prelude is not None:
                found.append((f"{file}:{call.lineno}", prelude + textwrap.dedent(body)))
    return found


SCRIPTS = scripts()


def test_the_gpu_tests_scripts_are_found():
    # The files that use run() hold dozens of scripts: a parser that found none would
    # make the test below check nothing.
    assert len(SCRIPTS) >= 30, len(SCRIPTS)


@pytest.mark.parametrize("where,code", SCRIPTS, ids=[w for w, _ in SCRIPTS])
def test_each_script_compiles(where, code):
    try:
        compile(code, where, "exec")
    except SyntaxError as exc:
        pytest.fail(f"{where}: the script run in a child process does not compile: {exc}")
