"""Pool options, part five: the option table of docs/options.md, generated from the table
of options so that the two cannot drift apart (tests/core/test_config.py checks the page holds
it). ``mempool._config`` is the way in.
"""
from __future__ import annotations

from mempool._conf_options import _ALIASES, OPTIONS, _default
from mempool._conf_parse import MiB, parse_size


def _alias_example(alias: str) -> str:
    """A conf value for `alias`, for the docs: the option's example in MB where it is one."""
    target, _ = _ALIASES[alias]
    if alias == "per_process_memory_fraction":
        return "0.5"
    try:
        n = parse_size(OPTIONS[target].example)
    except ValueError:
        n = 0
    return str(n // MiB) if n and n % MiB == 0 else "1024"


def _markdown_table() -> str:
    """The option table of docs/options.md, generated so that the two cannot drift apart."""
    rows = ["| option | type | default | meaning | conf spelling | PyTorch equivalent |",
            "|---|---|---|---|---|---|"]
    for name, opt in OPTIONS.items():
        default = _default(name)
        if name == "roundup_power2_divisions":
            shown = "0"
        else:
            shown = repr(default)
        conf = ", ".join([f"`{name}:{opt.example}`"] + [
            f"`{alias}:{_alias_example(alias)}`"
            for alias, (target, _) in _ALIASES.items() if target == name])
        pytorch = opt.pytorch or "none"
        if opt.cuda_only:
            pytorch += " (backend='cuda' only)"
        cells = [f"`{name}`", opt.kind, f"`{shown}`", opt.doc, conf, pytorch]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
