"""mempool/_torch_settings.py: under an installed pool, PyTorch's runtime allocator settings
still reach PyTorch, and each key meant for the CUDA caching allocator (which the pool
replaced) warns once instead of changing nothing in silence. No PyTorch needed: a stand-in
for torch.cuda.memory."""
import types
import warnings

import pytest

from mempool import _torch_settings


@pytest.fixture
def memory(monkeypatch):
    monkeypatch.setattr(_torch_settings, "_warned", set())
    calls = []

    def _set_allocator_settings(env):
        """PyTorch's own."""
        if env == "bad":
            raise RuntimeError("Unrecognized key 'bad' in Caching Allocator Config.")
        calls.append(env)
        return None

    module = types.SimpleNamespace(_set_allocator_settings=_set_allocator_settings)
    _torch_settings.guard(module)
    return module, calls


def caught(fn, *args):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(*args)
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def test_a_device_allocator_key_reaches_pytorch_and_warns_once(memory):
    module, calls = memory
    said = caught(module._set_allocator_settings, "expandable_segments:True")
    assert calls == ["expandable_segments:True"]
    assert len(said) == 1 and "'expandable_segments' configures PyTorch's CUDA caching " \
        "allocator, which mempool.torch.install replaced" in said[0], said
    assert caught(module._set_allocator_settings, "expandable_segments:False") == []
    assert calls[-1] == "expandable_segments:False"
    said = caught(module._set_allocator_settings,
                  "garbage_collection_threshold:0.5, max_split_size_mb:128")
    assert [s.split("'")[1] for s in said] == ["garbage_collection_threshold",
                                              "max_split_size_mb"]


def test_pinned_memory_keys_stay_pytorchs_and_warn_nothing(memory):
    module, calls = memory
    assert caught(module._set_allocator_settings,
                  "pinned_use_background_threads:True,pinned_num_register_threads:8") == []
    assert calls == ["pinned_use_background_threads:True,pinned_num_register_threads:8"]


def test_pytorchs_refusal_is_unchanged_and_warns_nothing(memory):
    module, calls = memory
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="Unrecognized key 'bad'"):
            module._set_allocator_settings("bad")
    assert calls == []


def test_guarding_twice_wraps_once_and_keeps_pytorchs_doc(memory):
    module, calls = memory
    wrapped = module._set_allocator_settings
    _torch_settings.guard(module)
    assert module._set_allocator_settings is wrapped
    assert wrapped.__doc__ == "PyTorch's own."
    _torch_settings.guard(types.SimpleNamespace())        # a PyTorch without it: nothing


@pytest.mark.parametrize("settings,keys", [
    ("", []), (",,", []), (None, []), (42, []),
    ("roundup_power2_divisions:[256:1,512:2],expandable_segments:True",
     ["roundup_power2_divisions", "expandable_segments"]),
    (" backend : cudaMallocAsync ", ["backend"]),
])
def test_device_allocator_keys(settings, keys):
    assert _torch_settings.device_allocator_keys(settings) == keys
