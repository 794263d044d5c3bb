"""mempool/_torch_settings.py: under an installed pool, PyTorch's runtime allocator settings
(torch.cuda.memory._set_allocator_settings) act on the pools as on PyTorch's own allocator:
the rounding, split limit and collection threshold change, each call setting all three as
PyTorch's does; the rest either cannot apply to a pool (a warning, once) or is PyTorch's
host allocator's (silent). No PyTorch needed: a stand-in for torch.cuda.memory and sim
pools."""
import types
import warnings

import pytest

import mempool
from mempool import _torch_settings

MiB = 1 << 20


def power2_div(size, div_factor):
    """PyTorch's own test's model of roundup_power2_divisions (test_allocator_settings)."""
    pow2 = 1
    while pow2 < size:
        pow2 *= 2
    if pow2 == size:
        return pow2
    step = pow2 / 2 / div_factor
    ret = pow2 / 2
    while ret < size:
        ret += step
    return int(ret)


def sim(**options):
    return mempool.Pool(backend="sim", capacity="8GiB", **options)


@pytest.fixture
def memory(monkeypatch):
    """A stand-in torch.cuda.memory guarded over the pools in `pools` (a list the test
    fills), and the strings PyTorch was given."""
    monkeypatch.setattr(_torch_settings, "_warned", set())
    calls, pools = [], []

    def _set_allocator_settings(env):
        """PyTorch's own."""
        if "bad" in env:
            raise RuntimeError("Unrecognized CachingAllocator option: bad")
        calls.append(env)

    module = types.SimpleNamespace(_set_allocator_settings=_set_allocator_settings)
    _torch_settings.guard(module, lambda: pools)
    return module._set_allocator_settings, calls, pools


def said(fn, *args):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(*args)
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def block_size(pool, nbytes):
    """The block a request of `nbytes` gets from an empty pool (PyTorch's test empties the
    cache between its requests, so none is served from a block cut to another rounding)."""
    pool.empty_cache()
    ptr = pool.alloc(nbytes)
    size = pool.block_info(ptr)[0]
    pool.free(ptr)
    return size


def test_rounding_follows_each_call_as_pytorchs_own_test_expects(memory):
    """The sequence of PyTorch's test_allocator_settings, on a pool: each call's rounding
    applies to the next request, and a call that leaves the rounding out sets it back."""
    settings, calls, pools = memory
    pool = sim()
    pools.append(pool)
    nbytes, nbytes_big = 4 * 21 * MiB, 4 * 100 * MiB
    settings("")
    assert block_size(pool, nbytes) == nbytes
    assert said(settings, "roundup_power2_divisions:4") == []
    assert block_size(pool, nbytes) == power2_div(nbytes, 4) == 96 * MiB
    settings("garbage_collection_threshold:0.5")
    settings("garbage_collection_threshold:0.5,max_split_size_mb:40")
    assert block_size(pool, nbytes) == nbytes                 # the rounding went back to none
    assert pool.options["max_split_size"] == 40 * MiB
    assert pool.options["garbage_collection_threshold"] == 0.5
    settings("garbage_collection_threshold:0.5,"
             "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
    assert block_size(pool, nbytes) == power2_div(nbytes, 8)
    assert block_size(pool, nbytes_big) == power2_div(nbytes_big, 2)
    assert pool.options["max_split_size"] is None             # left out: back to none
    assert said(settings, "release_lock_on_cudamalloc:True") != []
    assert block_size(pool, nbytes) == nbytes
    assert pool.options["garbage_collection_threshold"] == 0.0
    assert calls[0] == "" and calls[-1] == "release_lock_on_cudamalloc:True"
    pool.check_invariants()


def test_every_installed_pool_follows(memory):
    settings, _, pools = memory
    pools.extend([sim(), sim(device=1)])
    settings("roundup_power2_divisions:2")
    assert [block_size(p, 5 * MiB // 2) for p in pools] == [3 * MiB, 3 * MiB]


def test_the_private_pools_of_a_routed_device_follow_too(memory):
    """Note [Private pools follow the size policy]: PyTorch's graphs and MemPools read its
    one config, so a runtime change reaches the private pools the glue made before it (a
    sim pool listed as one stands for a graph's); the collection threshold stays off there,
    and a private pool once released follows no more."""
    from mempool import _core
    settings, _, pools = memory
    device = 6
    routed = sim(device=device)
    _core._torch_register(device, routed)
    graph, gone, elsewhere = sim(device=device), sim(device=device), sim(device=device)
    try:
        _core._torch_track_private(device, graph)
        _core._torch_track_private(device, gone)
        _core._torch_track_private(device + 1, elsewhere)     # another device's: untouched
        _core._torch_release_private(gone)
        pools.append(routed)
        settings("roundup_power2_divisions:2,max_split_size_mb:64,"
                 "garbage_collection_threshold:0.5")
        for pool in (routed, graph):
            assert block_size(pool, 5 * MiB // 2) == 3 * MiB
            assert pool.stats()["max_split_size"] == 64 * MiB
        assert routed.options["garbage_collection_threshold"] == 0.5
        for pool in (gone, elsewhere):
            assert block_size(pool, 5 * MiB // 2) == 5 * MiB // 2
            assert pool.stats()["max_split_size"] == -1
        settings("")                                           # all three back to none
        assert block_size(graph, 5 * MiB // 2) == 5 * MiB // 2
        assert graph.stats()["max_split_size"] == -1
        assert _core._torch_follow_size_policy(gone) is False  # not routed: nothing to do
    finally:
        _core._torch_release_private(graph)
        _core._torch_release_private(elsewhere)
        _core._torch_unregister(device)
    for pool in (routed, graph, gone, elsewhere):
        pool.check_invariants()
    with pytest.raises(ValueError, match="not listed"):
        _core._torch_release_private(graph)


def test_a_value_the_pool_refuses_changes_nothing_anywhere(memory):
    settings, calls, pools = memory
    pool = sim(roundup_power2_divisions=4)
    pools.append(pool)
    before = dict(pool.options)
    for bad in ("garbage_collection_threshold:1.5", "roundup_power2_divisions:3",
                "max_split_size_mb:1", "expandable_segments:maybe"):
        with pytest.raises(ValueError):
            settings(bad)
    assert calls == [] and pool.options == before


def test_pytorchs_refusal_changes_nothing_and_warns_nothing(memory):
    settings, calls, pools = memory
    pool = sim(roundup_power2_divisions=4)
    pools.append(pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="Unrecognized CachingAllocator option: bad"):
            settings("roundup_power2_divisions:2,bad:1")
    assert calls == [] and pool.options["roundup_power2_divisions"] == [4] * 16


def test_expandable_segments_switch_the_devices_segment_kind_silently(memory):
    # Note [Segment kind at run time]: under mempool's full allocator the device's later
    # allocations go to a companion pool of the asked kind while it differs from the pool's.
    from mempool import _core
    settings, calls, pools = memory
    device = 11   # a slot no other test routes
    fixed = mempool.Pool(backend="sim", capacity="1GiB", device=device)
    pools.append(fixed)
    _core._torch_register(device, fixed)
    try:
        assert said(settings, "expandable_segments:True") == []
        assert _core._torch_kind_switched(device)
        assert fixed.options["expandable_segments"] is False      # the pool itself stays
        assert said(settings, "expandable_segments:False") == []
        assert not _core._torch_kind_switched(device)
        settings("expandable_segments:True")
        _core._torch_unregister(device)
        assert not _core._torch_kind_switched(device)              # nothing routed there
        expandable = mempool.Pool(backend="sim", capacity="1GiB", device=device,
                                  expandable_segments=True)
        _core._torch_register(device, expandable)                  # already that kind
        assert not _core._torch_kind_switched(device)
        settings("expandable_segments:False")
        assert _core._torch_kind_switched(device)
    finally:
        _core._torch_set_expandable(device, False)
        _core._torch_unregister(device)
    assert calls == ["expandable_segments:True", "expandable_segments:False",
                     "expandable_segments:True", "expandable_segments:False"]


def test_expandable_segments_under_the_pluggable_allocator_warn_once(monkeypatch):
    # PyTorch's pluggable allocator forwards allocation and free only: it cannot switch.
    monkeypatch.setattr(_torch_settings, "_warned", set())
    calls, pools = [], []
    module = types.SimpleNamespace(_set_allocator_settings=calls.append)
    _torch_settings.guard(module, lambda: pools, switch_kind=False)
    settings = module._set_allocator_settings
    fixed, expandable = sim(), sim(expandable_segments=True)
    pools.extend([fixed, expandable])
    msgs = said(settings, "expandable_segments:True")
    assert len(msgs) == 1 and "cannot switch the pool on device 0 under PyTorch's pluggable " \
        "allocator, whose segments are fixed" in msgs[0], msgs
    assert "allocator='full'" in msgs[0]
    assert said(settings, "expandable_segments:True") == []          # once
    msgs = said(settings, "expandable_segments:False")
    assert len(msgs) == 1 and "whose segments are expandable" in msgs[0], msgs
    assert fixed.options["expandable_segments"] is False
    assert expandable.options["expandable_segments"] is True
    assert calls == ["expandable_segments:True"] * 2 + ["expandable_segments:False"]


def test_set_expandable_refuses_odd_values_and_devices():
    from mempool import _core
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="expandable: expected a bool"):
            _core._torch_set_expandable(11, bad)
    for device, err in ((-1, ValueError), (64, ValueError), ("0", TypeError)):
        with pytest.raises(err, match="device"):
            _core._torch_set_expandable(device, True)
    assert not _core._torch_kind_switched(11)


def test_an_expandable_pool_ignores_the_split_limit_as_pytorch_does(memory):
    settings, _, pools = memory
    fixed, expandable = sim(), sim(expandable_segments=True)
    pools.extend([fixed, expandable])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings("max_split_size_mb:64,garbage_collection_threshold:0.25")
    assert fixed.options["max_split_size"] == 64 * MiB
    assert expandable.options["max_split_size"] is None
    assert expandable.options["garbage_collection_threshold"] == 0.25


def test_keys_without_meaning_warn_once_and_pinned_keys_say_nothing(memory):
    settings, calls, pools = memory
    pools.append(sim())
    msgs = said(settings, "max_non_split_rounding_mb:64,backend:native")
    assert [m.split("'")[1] for m in msgs] == ["max_non_split_rounding_mb", "backend"], msgs
    assert "has no meaning for the pool" in msgs[0]
    assert said(settings, "max_non_split_rounding_mb:64") == []
    assert said(settings, "pinned_use_background_threads:True,"
                          "pinned_num_register_threads:8") == []
    assert calls[-1] == "pinned_use_background_threads:True,pinned_num_register_threads:8"


def test_guarding_twice_wraps_once_and_keeps_pytorchs_doc(memory):
    settings, _, _ = memory
    module = types.SimpleNamespace(_set_allocator_settings=settings)
    _torch_settings.guard(module, list)
    assert module._set_allocator_settings is settings
    assert settings.__doc__ == "PyTorch's own."
    _torch_settings.guard(types.SimpleNamespace(), list)   # a PyTorch without it: nothing


@pytest.mark.parametrize("settings,keys", [
    ("", []), (",,", []), (None, []), (42, []),
    ("roundup_power2_divisions:[256:1,512:2],expandable_segments:True",
     ["roundup_power2_divisions", "expandable_segments"]),
    (" backend : cudaMallocAsync ", ["backend"]),
    ("pinned_use_background_threads:True,max_split_size_mb:64", ["max_split_size_mb"]),
])
def test_device_allocator_keys(settings, keys):
    assert _torch_settings.device_allocator_keys(settings) == keys


@pytest.mark.parametrize("settings,policy,expandable", [
    ("", {"roundup_power2_divisions": 0, "max_split_size": None,
          "garbage_collection_threshold": 0.0}, None),
    ("max_split_size_mb:40,max_split_size_mb:64,expandable_segments:False",
     {"roundup_power2_divisions": 0, "max_split_size": 64 * MiB,
      "garbage_collection_threshold": 0.0}, False),
])
def test_pool_settings_read_pytorchs_keys_with_its_defaults(settings, policy, expandable):
    assert _torch_settings.pool_settings(settings) == (policy, expandable)


def test_every_entry_point_pytorch_has_is_guarded_once(monkeypatch):
    """torch.cuda.memory._set_allocator_settings and the binding PyTorch 2.9+ points to
    instead (torch._C._accelerator_setAllocatorSettings) both act on the pools; a PyTorch
    without the binding gets the one it has."""
    monkeypatch.setattr(_torch_settings, "_warned", set())
    seen = []
    memory = types.SimpleNamespace(_set_allocator_settings=lambda env: seen.append(("cuda", env)))
    binding = types.SimpleNamespace(
        _accelerator_setAllocatorSettings=lambda env: seen.append(("acc", env)))
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(memory=memory), _C=binding)
    pool = sim()
    _torch_settings.guard_torch(torch, lambda: [pool])
    _torch_settings.guard_torch(torch, lambda: [pool])              # twice: wrapped once
    torch._C._accelerator_setAllocatorSettings("roundup_power2_divisions:4")
    assert pool.options["roundup_power2_divisions"] == [4] * 16
    torch.cuda.memory._set_allocator_settings("")
    assert pool.options["roundup_power2_divisions"] == [0] * 16
    assert seen == [("acc", "roundup_power2_divisions:4"), ("cuda", "")]
    assert torch._C._accelerator_setAllocatorSettings.__name__ == \
        "_accelerator_setAllocatorSettings"
    old = types.SimpleNamespace(cuda=types.SimpleNamespace(memory=types.SimpleNamespace(
        _set_allocator_settings=lambda env: None)), _C=types.SimpleNamespace())
    _torch_settings.guard_torch(old, lambda: [pool])                # no binding: the one
    old.cuda.memory._set_allocator_settings("roundup_power2_divisions:2")
    assert pool.options["roundup_power2_divisions"] == [2] * 16


def test_capture_reuse_follows_the_call_and_reaches_private_pools(memory):
    """graph_capture_record_stream_reuse turns Note [Capture reuse] on in every installed
    pool and the device's private pools; a call that leaves it out keeps it (PyTorch's
    config keeps it too); a bad value changes nothing and warns of nothing."""
    from mempool import _core
    settings, calls, pools = memory
    device = 6
    routed = sim(device=device)
    _core._torch_register(device, routed)
    graph = sim(device=device)
    try:
        _core._torch_track_private(device, graph)
        pools.append(routed)
        with pytest.raises(ValueError, match="graph_capture_record_stream_reuse"):
            settings("graph_capture_record_stream_reuse:sometimes")
        assert calls == [] and routed.options["graph_capture_record_stream_reuse"] is False
        assert said(settings, "graph_capture_record_stream_reuse:True") == []
        assert routed.options["graph_capture_record_stream_reuse"] is True
        settings("roundup_power2_divisions:2")
        assert routed.options["graph_capture_record_stream_reuse"] is True
        # The private pool reuses within a capture now: its core config says so.
        dev = graph.device
        dev.begin_capture(11)
        dev.launch(11)
        a = graph.alloc(MiB, stream=11)
        dev.capture_join(22, 11)
        graph.record_stream(a, 22)
        dev.launch(22)
        graph.free(a, stream=11)
        dev.capture_join(11, 22)
        assert graph.alloc(MiB, stream=11) == a
        dev.end_capture(11)
        settings("graph_capture_record_stream_reuse:False")
        assert routed.options["graph_capture_record_stream_reuse"] is False
    finally:
        _core._torch_release_private(graph)
        _core._torch_unregister(device)
