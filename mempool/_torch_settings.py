"""PyTorch's runtime allocator settings under an installed pool.

``torch.cuda.memory._set_allocator_settings("roundup_power2_divisions:4")`` reconfigures
PyTorch's own CUDA caching allocator while a program runs (serving engines switch
expandable segments around their weight loading this way, and PyTorch's own tests change
the rounding between allocations). Once ``mempool.torch.install`` has replaced that
allocator, PyTorch still parses the string and keeps it, but nothing of PyTorch's reads the
device allocator's keys any more. :func:`guard` wraps the function so that the call acts on
the installed pools as it would on PyTorch's allocator:

- ``roundup_power2_divisions``, ``max_split_size_mb`` and ``garbage_collection_threshold``
  change every installed pool's size policy (``Pool.set_size_policy``) from the next
  request on. As in PyTorch, each call sets all three: one the string leaves out goes back
  to its default (no rounding, no split limit, no collection), whatever it was before.
- ``expandable_segments`` switches the kind of the device's later segments, as in PyTorch:
  under mempool's full allocator, while the value differs from the pool's own kind, the
  device's allocations go to a companion pool of the other kind, and the blocks already
  made stay where they are (Note [Segment kind at run time] in
  ``mempool/_csrc/glue/mp_torch_private.c``). Under PyTorch's pluggable allocator a value
  other than the pool's warns once (``RuntimeWarning``) and the pool keeps its segments.
- ``graph_capture_record_stream_reuse`` turns the pools' reuse of ``record_stream`` blocks
  during a CUDA graph capture on or off (``Pool.set_capture_reuse``, Note [Capture reuse]);
  a call that leaves it out keeps it as it was, as PyTorch's config does.
- The pinned-memory keys (``pinned_*``) configure PyTorch's host allocator, which stays
  PyTorch's: they act as before and say nothing.
- Every other key of PyTorch's caching allocator has no meaning for the pool and warns once.

The string is read here before PyTorch sees it: a value the pool refuses raises and
changes nothing, in PyTorch or in the pools. PyTorch's errors for a malformed string are
its own, and the pools change only once PyTorch has taken the string. The private pools
the glue makes for CUDA graphs and ``MemPool`` take the device pool's rounding and split
limit too, those made before the call included, as PyTorch's private pools read its one
config (Note [Private pools follow the size policy] in ``mempool/_csrc/glue/mp_torch.c``).
"""
import warnings

from mempool import _config, _core

HOST_KEY_PREFIX = "pinned_"
# The keys applied to the pools, as PyTorch spells them in a settings string.
POLICY_KEYS = ("roundup_power2_divisions", "max_split_size_mb", "garbage_collection_threshold")
# What a call sets a policy key back to when its string leaves it out (PyTorch's parseArgs).
POLICY_RESET = {"roundup_power2_divisions": 0, "max_split_size": None,
                "garbage_collection_threshold": 0.0}
_warned = set()   # topics already warned of in this process (one warning each)


def device_allocator_keys(settings):
    """The keys of a ``"key:value,key:value"`` string that configure the CUDA device
    allocator (every key but PyTorch's host allocator's ``pinned_*``), in order (a key given
    twice where it last appears)."""
    return [key for key, _ in _top_level_entries(settings)
            if not key.startswith(HOST_KEY_PREFIX)]


def _top_level_entries(settings):
    """``(key, value)`` of each entry, read by the conf tokenizer without refusing anything
    (PyTorch's errors for a malformed string are its own): a value may be a bracketed list
    with commas of its own (``roundup_power2_divisions:[256:1,512:2]``). A key given twice
    is kept once, with its last value (PyTorch's later one wins)."""
    entries = {}
    for key, value in _config._loose_entries(settings):
        entries.pop(key, None)
        entries[key] = value
    return list(entries.items())


CAPTURE_REUSE_KEY = "graph_capture_record_stream_reuse"


def pool_settings(settings):
    """What a settings string asks of the pools: ``(policy, expandable)``, where `policy`
    maps each option of ``Pool.set_size_policy`` to its value (PyTorch's default for one
    the string leaves out) and `expandable` is the ``expandable_segments`` value asked for,
    or None. Raises ValueError, naming the entry, for a value the pool does not accept."""
    policy = dict(POLICY_RESET)
    expandable = None
    entries = _top_level_entries(settings)
    given = ",".join(f"{k}:{v}" for k, v in entries if k in POLICY_KEYS)
    if given:
        policy.update(_config.parse_conf(given, "torch.cuda.memory._set_allocator_settings"))
    for key, value in entries:
        if key == "expandable_segments":
            expandable = _config.OPTIONS["expandable_segments"].parse(value, key)
        elif key == CAPTURE_REUSE_KEY:
            _config.OPTIONS[key].parse(value, key)   # checked here, before anything changes
    return policy, expandable


def _capture_reuse(settings):
    """The ``graph_capture_record_stream_reuse`` value a settings string gives, or None."""
    for key, value in _top_level_entries(settings):
        if key == CAPTURE_REUSE_KEY:
            return _config.OPTIONS[CAPTURE_REUSE_KEY].parse(value, key)
    return None


def _warn_once(topic, message):
    if topic in _warned:
        return
    _warned.add(topic)
    warnings.warn(message, RuntimeWarning, stacklevel=4)   # the caller of the wrapper


def apply(settings, pools, parsed=None, switch_kind=True):
    """Apply a settings string PyTorch has taken to `pools` (see the module docstring);
    `parsed`: what pool_settings(settings) gave, when the caller has it already;
    `switch_kind`: whether the installed allocator switches the segment kind (mempool's
    full allocator does, PyTorch's pluggable one cannot). Raises
    ValueError, changing nothing, where the pool refuses a value."""
    policy, expandable = parsed if parsed is not None else pool_settings(settings)
    reuse = _capture_reuse(settings)
    for pool in pools:             # every value was checked above: none of these raises
        # PyTorch's precedence: expandable segments ignore max_split_size (no warning here)
        pool.set_size_policy(**dict(policy, max_split_size=_config.applied_max_split(
            policy["max_split_size"], pool.options["expandable_segments"])))
        if reuse is not None:
            pool.set_capture_reuse(reuse)
        # Note [Private pools follow the size policy]: the device's graphs and MemPools too
        _core._torch_follow_size_policy(pool)
    if expandable is not None:
        for pool in pools:
            # Note [Segment kind at run time] (mp_torch_private.c): the C++ allocator sends
            # the device's later allocations to a companion pool of the asked kind.
            if switch_kind:
                _core._torch_set_expandable(pool.device_id, expandable)
            elif bool(pool.options["expandable_segments"]) != expandable:
                made = "expandable" if pool.options["expandable_segments"] else "fixed"
                _warn_once(("expandable_segments", expandable, made),
                           f"torch.cuda.memory._set_allocator_settings: "
                           f"'expandable_segments:{expandable}' cannot switch the pool on "
                           f"device {pool.device_id} under PyTorch's pluggable allocator, "
                           f"whose segments are {made} since it was made; it keeps them "
                           f"(mempool's full allocator switches: "
                           f"mempool.torch.install(allocator='full'))")
    for key in device_allocator_keys(settings):
        if key in POLICY_KEYS or key in ("expandable_segments", CAPTURE_REUSE_KEY):
            continue
        why = _config.pytorch_key_ignored_because(key)
        _warn_once((key,),
                   f"torch.cuda.memory._set_allocator_settings: {key!r} configures PyTorch's "
                   f"CUDA caching allocator, which mempool.torch.install replaced; it has no "
                   f"meaning for the pool ({why}) and changes nothing. The pool applies "
                   f"roundup_power2_divisions, max_split_size_mb, "
                   f"garbage_collection_threshold and graph_capture_record_stream_reuse; the "
                   f"pinned-memory keys (pinned_*) still "
                   f"configure PyTorch's host allocator.")


# Where PyTorch takes runtime allocator settings: torch.cuda.memory's function, and the
# binding that 2.9 and later point users to instead (torch.cuda's now warns that it is
# deprecated and calls this one, so a string may pass both wrappers: applying it twice
# changes nothing more, and each warning is given once).
ENTRY_POINTS = (("torch.cuda.memory", "_set_allocator_settings"),
                ("torch._C", "_accelerator_setAllocatorSettings"))


def guard_torch(torch, pools, switch_kind=True):
    """:func:`guard` every entry point of ENTRY_POINTS that this PyTorch has."""
    for module_name, attribute in ENTRY_POINTS:
        module = torch
        for part in module_name.split(".")[1:]:
            module = getattr(module, part, None)
        if module is not None:
            guard(module, pools, attribute, switch_kind)


def guard(memory_module, pools, attribute="_set_allocator_settings", switch_kind=True):
    """Wrap ``memory_module.<attribute>`` (``torch.cuda.memory._set_allocator_settings``
    by default) so that its settings act on the pools ``pools()`` returns (see the module
    docstring; `switch_kind` as for :func:`apply`). Does nothing where PyTorch has no such
    function or it is wrapped already."""
    original = getattr(memory_module, attribute, None)
    if original is None or getattr(original, "_mempool_guarded", False):
        return

    def _set_allocator_settings(env):
        parsed = pool_settings(env)    # a value the pool refuses raises before PyTorch takes it
        result = original(env)         # PyTorch parses, refuses and keeps it as usual
        apply(env, pools(), parsed, switch_kind)
        return result

    _set_allocator_settings._mempool_guarded = True
    _set_allocator_settings.__wrapped__ = original
    _set_allocator_settings.__doc__ = original.__doc__
    _set_allocator_settings.__name__ = attribute
    setattr(memory_module, attribute, _set_allocator_settings)
