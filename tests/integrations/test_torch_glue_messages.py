"""Every error the PyTorch glue raises hands TORCH_CHECK one message string.

c10::str of several arguments instantiates iostream code in the glue's library, and on the
GPU machines every message built that way crashed the process inside that code (a
segmentation fault where PyTorch's allocator raises a RuntimeError: the glue's raw_delete
did so for a bad pointer). The glue builds its messages with cat() (torch_allocator.h).
This reads the source, so it needs neither PyTorch nor a GPU.
"""
import re
from pathlib import Path

GLUE_DIR = Path(__file__).resolve().parents[2] / "mempool" / "_csrc" / "glue"


def glue_source():
    """The C++ glue: torch_allocator.cpp, its header and the parts it includes."""
    files = [GLUE_DIR / "torch_allocator.h", *sorted(GLUE_DIR.glob("torch_*.cpp"))]
    assert len(files) > 2, "the glue's parts are missing: the parse is stale"
    return "\n".join(p.read_text() for p in files)

# The macro and how many arguments it takes before its message.
CHECKS = {"TORCH_CHECK": 1, "TORCH_CHECK_WITH": 2, "TORCH_INTERNAL_ASSERT": 1,
          "TORCH_CHECK_VALUE": 1, "TORCH_CHECK_TYPE": 1, "TORCH_CHECK_INDEX": 1,
          "TORCH_CHECK_NOT_IMPLEMENTED": 1, "TORCH_WARN": 0, "TORCH_WARN_ONCE": 0}


def call_arguments(text, start):
    """The top-level arguments of the call whose '(' is at text[start]."""
    depth, args, current, i = 0, [], [], start
    while i < len(text):
        c = text[i]
        if c == '"' or c == "'":   # a literal, escapes included
            j = i + 1
            while text[j] != c:
                j += 2 if text[j] == "\\" else 1
            current.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return args
        elif c == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
            i += 1
            continue
        current.append(c)
        i += 1
    raise AssertionError(f"unbalanced call at offset {start}")


def checks_with_several_message_parts(source):
    code = re.sub(r"//[^\n]*", "", source)   # comments may name the macros
    found = []
    for m in re.finditer(r"\b(" + "|".join(CHECKS) + r")\s*\(", code):
        args = call_arguments(code, m.end() - 1)
        if len(args) > CHECKS[m.group(1)] + 1:
            line = code.count("\n", 0, m.start()) + 1
            found.append(f"line {line}: {m.group(1)} with {len(args)} arguments")
    return found


def test_each_check_of_the_glue_passes_one_message():
    source = glue_source()
    assert re.search(r"\bTORCH_CHECK\s*\(", source), "no TORCH_CHECK found: the parse is stale"
    assert checks_with_several_message_parts(source) == []


# PyTorch's macros that build a message of several parts inside their own expansion.
SEVERAL_PARTS_INSIDE = ("C10_CUDA_CHECK_WARN", "TORCH_CHECK_EQ", "TORCH_CHECK_NE",
                        "TORCH_CHECK_LE", "TORCH_CHECK_LT", "TORCH_CHECK_GE", "TORCH_CHECK_GT")


def test_the_glue_uses_no_macro_that_builds_its_message_in_parts():
    code = re.sub(r"//[^\n]*", "", glue_source())
    used = [m for m in SEVERAL_PARTS_INSIDE if re.search(r"\b" + m + r"\s*\(", code)]
    assert used == []


def test_a_message_in_several_parts_is_found():
    bad = 'void f(void* p) {\n  TORCH_CHECK(p != nullptr, "invalid device pointer: ", p);\n}\n'
    good = 'void f(void* p) {\n  TORCH_CHECK(g(a, b), cat("x, y", p));  // TORCH_CHECK(a, b, c)\n}\n'
    assert checks_with_several_message_parts(bad) == ["line 2: TORCH_CHECK with 3 arguments"]
    assert checks_with_several_message_parts(good) == []
