"""Pool options, part four: conf strings in and out. Reading one (:func:`parse_conf`, the
``MEMPOOL_CONF`` variable) into options, and writing options out as our own conf string
(:func:`to_conf`) or as the nearest ``PYTORCH_CUDA_ALLOC_CONF`` (:func:`to_pytorch_conf`).
``mempool._config`` is the way in.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from mempool import _conf_parse
from mempool._conf_options import (_ALIASES, OPTIONS, _default, _unknown_key, normalize)
from mempool._conf_parse import (MIN_MAX_SPLIT_SIZE, MiB, PYTORCH_BACKENDS, ROUNDUP_INTERVALS,
                                 _entries, _parse_device, _parse_pool_handle, _warn_once,
                                 _was_warned, format_size)
from mempool._conf_torch import _CACHE_OPTIONS, _PYTORCH_IGNORED, _backend_ignored


def parse_conf(conf: str, source: str = "conf") -> dict[str, Any]:
    """Parse a conf string in PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax.

    ``"key:value,key:value"``; a list value is bracketed and may hold commas and colons
    (``"roundup_power2_divisions:[256:1,>:8]"``); whitespace is ignored. Every Pool keyword
    is a key (``backend``, ``device`` and ``capacity`` included), and every size option
    ``NAME`` is also ``NAME_mb`` (a whole number of MiB, as PyTorch's
    ``max_split_size_mb``); PyTorch's ``per_process_memory_fraction`` is read onto ``limit``.

    A string PyTorch accepts is accepted here, read the way PyTorch reads it; each of these
    gives one :class:`ConfigWarning` per process:

    - PyTorch's other allocator keys (``pinned_*``, ``release_lock_on_cudamalloc``, ...)
      and its ``backend`` values ``native``/``cudaMallocAsync`` have no meaning for the
      pool and are ignored;
    - an option given twice (in either spelling): the later one wins;
    - with ``backend:cudaMallocAsync``, the caching options PyTorch's cudaMallocAsync
      ignores (``max_split_size``, ``roundup_power2_divisions``,
      ``garbage_collection_threshold``, ``expandable_segments``) are ignored too.

    Parameters
    ----------
    conf : str
        The conf string; ``""`` gives ``{}``.
    source : str
        Where the string came from, named in error and warning messages.

    Returns
    -------
    dict
        Only the options set, under their canonical names, each value parsed (pass it to
        :func:`normalize` for the defaults and the checks between options).

    Raises
    ------
    ValueError
        For a syntax error, a key that is neither an option, an alias nor a PyTorch
        allocator key, or a bad value.
    """
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    async_backend = None
    for key, value in _entries(conf, source):
        if key in _PYTORCH_IGNORED:
            _warn_once(("ignored", key),
                       f"{source}: {key!r} is a PyTorch allocator option with no meaning for "
                       f"the pool ({_PYTORCH_IGNORED[key]}); ignored")
            continue
        if key == "backend" and value in PYTORCH_BACKENDS:
            _backend_ignored(value, source)
            async_backend = None if value == "native" else value
            continue
        if key in _ALIASES:
            target, read = _ALIASES[key]
        elif key in OPTIONS:
            target, read = key, None
        else:
            raise _unknown_key(key, source)
        try:
            parsed = OPTIONS[target].parse(read(value, key) if read else value, key)
        except ValueError as e:
            raise ValueError(f"{source}: in '{key}:{value}': {e}") from None
        if target in out and not _was_warned(("twice", target)):
            # The topic is checked first: a string that repeats a key thousands of times
            # builds this message once, not once a repeat.
            _warn_once(("twice", target),
                       f"{source}: option {target!r} is given twice (as {spelled[target]!r} "
                       f"and {key!r}) in {_conf_parse._shown(conf)}; as in PyTorch, the "
                       f"later one ('{key}:{value}') wins")
        out[target] = parsed
        spelled[target] = key
    if async_backend is not None:
        dropped = [name for name in _CACHE_OPTIONS if name in out]
        if dropped:
            _warn_once(("async", async_backend, tuple(dropped)),
                       f"{source}: PyTorch's backend:{async_backend} ignores "
                       f"{', '.join(spelled[name] for name in dropped)} (it has no cache to "
                       "tune); read as PyTorch reads it, so does the pool")
            for name in dropped:
                del out[name]
    return out


def conf_from_env(var: str = "MEMPOOL_CONF") -> dict[str, Any]:
    """Parse the conf string in environment variable ``var`` (unset or empty: ``{}``).

    Errors name the variable.
    """
    return parse_conf(os.environ.get(var, ""), source=f"environment variable {var}")


# --------------------------------------------------------------------------- writing confs


def _roundup_to_conf(divs: list[int]) -> str | None:
    """The shortest PyTorch-syntax spelling that parses back to exactly ``divs``.

    None when every count is 0 (the default, which PyTorch's scalar form cannot spell).
    """
    last = ROUNDUP_INTERVALS - 1
    if all(d == divs[0] for d in divs):
        return None if divs[0] == 0 else str(divs[0])
    tail = last                      # divs[tail:] is the constant run at the end
    while divs[tail - 1] == divs[last]:
        tail -= 1
    lead = 0                         # divs[:lead + 1] is the constant run at the start
    while divs[lead + 1] == divs[0]:
        lead += 1
    # The first key (at `lead`) fills the indices below it; keys we skip in between read
    # as 0; the key just before the tail must be written so that '>' starts after it.
    items = [f"{1 << i}:{divs[i]}" for i in range(lead, tail)
             if divs[i] != 0 or i in (lead, tail - 1)]
    if divs[last] != 0:
        items.append(f">:{divs[last]}")
    return "[" + ",".join(items) + "]"


def _conf_value(name: str, value: Any) -> str:
    parser = OPTIONS[name].parse
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "True" if value else "False"
    if name == "roundup_power2_divisions":
        return _roundup_to_conf(value) or "0"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int) and parser not in (_parse_device, _parse_pool_handle):
        return format_size(value)
    return str(value)


def to_conf(options: Mapping[str, Any]) -> str:
    """Our own conf string (``MEMPOOL_CONF`` syntax) for a set of options.

    Only options that differ from their defaults are written, in table order; the result
    parses back (:func:`parse_conf` then :func:`normalize`) to the same options.
    """
    full = normalize(options)
    items = [f"{name}:{_conf_value(name, value)}" for name, value in full.items()
             if value != _default(name)]
    return ",".join(items)


def canonical_conf(conf: str, source: str = "conf") -> str:
    """`conf` with every option under its canonical name, as :func:`to_conf` writes it.

    Aliases become canonical names, PyTorch keys the pool ignores are left out (warned about
    as :func:`parse_conf` does), and no defaults are added or checks between options made:
    the result builds the same pool as `conf`, on whichever backend that comes to.
    """
    return ",".join(f"{name}:{_conf_value(name, value)}"
                    for name, value in parse_conf(conf, source).items())


def to_pytorch_conf(options: Mapping[str, Any]) -> str | None:
    """The nearest ``PYTORCH_CUDA_ALLOC_CONF`` string for a set of our options.

    Maps ``max_split_size`` (to whole MB), ``roundup_power2_divisions``,
    ``garbage_collection_threshold``, ``expandable_segments`` and ``limit`` (as
    ``per_process_memory_fraction``, a key of recent PyTorch; a byte limit only when
    ``capacity`` is known). Options PyTorch's allocator has no counterpart for
    (``release_threshold``, ``initial_pool_size``, ``cross_stream_reuse``, the cudaMemPool
    settings) are left out.

    Returns
    -------
    str or None
        None when PyTorch's defaults are already the nearest setting.
    """
    full = normalize(options)
    items = []
    if full["max_split_size"] is not None:
        least = MIN_MAX_SPLIT_SIZE // MiB
        items.append(f"max_split_size_mb:{max(least, round(full['max_split_size'] / MiB))}")
    roundup = _roundup_to_conf(full["roundup_power2_divisions"])
    if roundup is not None:
        items.append(f"roundup_power2_divisions:{roundup}")
    if full["garbage_collection_threshold"] > 0:
        items.append(f"garbage_collection_threshold:{full['garbage_collection_threshold']!r}")
    if full["expandable_segments"]:
        items.append("expandable_segments:True")
    limit, capacity = full["limit"], full["capacity"]
    if isinstance(limit, int) and capacity is not None:
        limit = min(1.0, limit / capacity)
    if isinstance(limit, float) and limit < 1.0:
        items.append(f"per_process_memory_fraction:{limit!r}")
    return ",".join(items) or None
