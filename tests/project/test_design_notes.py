"""Design notes (docs/architecture.md, "Design notes"): every note referenced anywhere
in the source tree has exactly one definition, and the index in docs/architecture.md names
each note with the file that holds it.

A definition is a line that holds the note's name and nothing else (besides comment marks or
a Markdown heading's #s), followed by its body; any other mention is a reference."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCANNED = ("mempool", "docs", "tests", "bench", "examples", "README.md")
SUFFIXES = (".c", ".h", ".cpp", ".pyx", ".pxd", ".pxi", ".py", ".md", ".sh")
GENERATED = {os.path.join("mempool", "_core.c")}   # Cython's output

NAME = r"Note \[([^\]\n]+)\]"
DEFINITION = re.compile(r"^\s*(?:/\*+|\*|//|#+)?\s*" + NAME + r"\s*(?:\*/)?\s*$")
INDEX_ROW = re.compile(r"^\|\s*" + NAME + r"\s*\|\s*`([^`]+)`")


def source_files():
    for top in SCANNED:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield top
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "build")]
            for f in files:
                rel = os.path.relpath(os.path.join(folder, f), ROOT)
                if f.endswith(SUFFIXES) and rel not in GENERATED:
                    yield rel


def scan():
    definitions, references = {}, {}
    for rel in source_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            m = DEFINITION.match(line)
            if m and not INDEX_ROW.match(line):
                body = next((l for l in lines[i + 1:i + 4] if l.strip(" *#/")), "")
                definitions.setdefault(m.group(1), []).append((rel, i + 1, bool(body)))
                continue
            for name in re.findall(NAME, line):
                references.setdefault(name, []).append((rel, i + 1))
    return definitions, references


def test_every_referenced_note_has_exactly_one_definition():
    definitions, references = scan()
    assert references, "no note is referenced: the scan found nothing"
    undefined = {n: refs[:3] for n, refs in references.items() if n not in definitions}
    assert not undefined, f"notes referenced but defined nowhere: {undefined}"
    twice = {n: [d[:2] for d in defs] for n, defs in definitions.items() if len(defs) > 1}
    assert not twice, f"notes defined more than once: {twice}"
    empty = [(n, defs[0][:2]) for n, defs in definitions.items() if not defs[0][2]]
    assert not empty, f"note definitions without a body: {empty}"


def test_the_index_names_each_note_where_it_is_defined():
    definitions, _ = scan()
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        rows = dict(m.groups() for m in map(INDEX_ROW.match, f) if m)
    assert set(rows) == set(definitions), (
        f"index rows without a note: {sorted(set(rows) - set(definitions))}; "
        f"notes missing from the index: {sorted(set(definitions) - set(rows))}")
    wrong = {n: (rows[n], definitions[n][0][0]) for n in rows
             if rows[n] != definitions[n][0][0].replace(os.sep, "/")}
    assert not wrong, f"index rows naming the wrong file (row, definition): {wrong}"
