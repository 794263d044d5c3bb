"""Pool options: the one table of them, and their parsing and validation.

No Pool is made here: configuration errors surface (and are tested) before the C core is
asked for anything, though the size policy they are checked against is the core's (read from
the extension, mempool/_policy.pxi). Three ways in, one set of rules:

- keywords: ``Pool(release_threshold="2GB", ...)`` -> :func:`normalize`;
- a conf string in PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax:
  ``Pool.from_conf("release_threshold:2GB,max_split_size_mb:64")`` -> :func:`parse_conf`;
- the ``MEMPOOL_CONF`` environment variable -> :func:`conf_from_env`.

Every bad value, and every key neither ours nor PyTorch's, is a ``ValueError`` that names
the key, the value, and what is accepted. A conf string is read the way PyTorch reads its
own (so strings copied from PyTorch guides work): the ``_mb`` spelling of every size option
is accepted; a PyTorch allocator key that has no meaning for the pool is accepted with a
one-time :class:`ConfigWarning` that says so; where settings contradict each other, PyTorch's
precedence decides, with a one-time warning. Nothing is ignored silently. Keywords
(``Pool(...)``) know the canonical names only.

This module is the way in; the work is done by one module per concern, each using only
those before it:

- ``_conf_parse``: errors and warnings, the parser of each kind of value, the tokenizer of
  conf strings (the one reader of ``key:value`` text in the package);
- ``_conf_torch``: PyTorch's allocator keys, which the pool reads and which it ignores;
- ``_conf_options``: the table of options, every default, and :func:`normalize`;
- ``_conf_io``: conf strings read into options and options written out as conf strings;
- ``_conf_docs``: the option table of docs/options.md.
"""
from __future__ import annotations

# The facade: every name other modules and tests read as mempool._config.NAME.
from mempool._conf_docs import _alias_example, _markdown_table  # noqa: F401
from mempool._conf_io import (  # noqa: F401
    _conf_value, _roundup_to_conf, canonical_conf, conf_from_env, parse_conf, to_conf,
    to_pytorch_conf)
from mempool._conf_options import (  # noqa: F401
    _ALIASES, DEFAULT_CAPACITY, DEFAULT_CUDA_PAGE, DEFAULT_GRANULARITY, OPTIONS, Option,
    _accepted_keys, _check_combination, _checked, _default, _overridden, _unknown_key,
    applied_max_split, normalize, overridden)
from mempool._conf_parse import (  # noqa: F401
    BACKENDS, DEVICE_END, GiB, KiB, LARGE_SEGMENT, MAX_ALLOC, MAX_ROUNDUP_DIVISIONS,
    MIN_MAX_SPLIT_SIZE, MiB, POOL_HANDLES, PYTORCH_BACKENDS, ROUNDUP_INTERVALS, SIZE_END,
    TiB, UNLIMITED_END, ConfigWarning, OptionError, _entries, _error, _loose_entries,
    _parse_backend, _parse_bool, _parse_device, _parse_limit, _parse_pool_handle, _shown,
    _tokenize, _warn_once, format_size, parse_roundup_divisions, parse_size)
from mempool._conf_torch import (  # noqa: F401
    _CACHE_OPTIONS, _PYTORCH_IGNORED, PYTORCH_HOST_KEYS, PYTORCH_KEYS, _backend_ignored,
    pytorch_key_ignored_because, split_pytorch_conf)

__all__ = [
    "OPTIONS", "Option", "ConfigWarning", "PYTORCH_KEYS", "PYTORCH_HOST_KEYS", "parse_size",
    "parse_roundup_divisions", "normalize", "overridden", "parse_conf", "conf_from_env",
    "to_conf", "canonical_conf", "split_pytorch_conf", "to_pytorch_conf", "format_size",
]
