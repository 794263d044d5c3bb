"""PyTorch's runtime allocator settings under an installed pool.

``torch.cuda.memory._set_allocator_settings("expandable_segments:True")`` reconfigures
PyTorch's own CUDA caching allocator while a program runs (serving engines switch expandable
segments around their weight loading this way). Once ``mempool.torch.install`` has replaced
that allocator, PyTorch still parses the string and keeps it, but nothing reads the device
allocator's keys any more: the call would change nothing and say nothing. The pool's options
are set when it is made (``MEMPOOL_CONF``, ``PYTORCH_CUDA_ALLOC_CONF`` before the first CUDA
call, or ``mempool.Pool(...)``), so :func:`guard` makes each such key warn, once per key and
process, after PyTorch has taken the call as usual (its errors for a malformed string are
unchanged). The pinned-memory keys (``pinned_*``) configure PyTorch's host allocator, which
stays PyTorch's under install: they act as before and warn nothing.
"""
import warnings

HOST_KEY_PREFIX = "pinned_"
_warned = set()   # keys already warned of in this process


def device_allocator_keys(settings):
    """The keys of a ``"key:value,key:value"`` string that configure the CUDA device
    allocator (every key but PyTorch's host allocator's ``pinned_*``), in order."""
    if not isinstance(settings, str):
        return []
    keys, depth, start = [], 0, 0
    # A value may be a bracketed list with commas of its own
    # (roundup_power2_divisions:[256:1,512:2]): split only at the top level.
    for i, ch in enumerate(settings + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            key = settings[start:i].split(":", 1)[0].strip()
            start = i + 1
            if key and not key.startswith(HOST_KEY_PREFIX) and key not in keys:
                keys.append(key)
    return keys


def guard(memory_module):
    """Wrap ``memory_module._set_allocator_settings`` (``torch.cuda.memory``'s) so that each
    device-allocator key it is given warns once. Does nothing where PyTorch has no such
    function or it is wrapped already."""
    original = getattr(memory_module, "_set_allocator_settings", None)
    if original is None or getattr(original, "_mempool_guarded", False):
        return

    def _set_allocator_settings(env):
        result = original(env)         # PyTorch parses, refuses and keeps it as usual
        for key in device_allocator_keys(env):
            if key in _warned:
                continue
            _warned.add(key)
            warnings.warn(
                f"torch.cuda.memory._set_allocator_settings: {key!r} configures PyTorch's "
                f"CUDA caching allocator, which mempool.torch.install replaced; it does not "
                f"change mempool's pool, whose options are set when the pool is made "
                f"(MEMPOOL_CONF, PYTORCH_CUDA_ALLOC_CONF before the first CUDA call, or "
                f"mempool.Pool(...)). The pinned-memory keys (pinned_*) still apply.",
                RuntimeWarning, stacklevel=2)
        return result

    _set_allocator_settings._mempool_guarded = True
    _set_allocator_settings.__wrapped__ = original
    _set_allocator_settings.__doc__ = original.__doc__
    memory_module._set_allocator_settings = _set_allocator_settings
