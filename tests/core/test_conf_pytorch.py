"""Conf strings as PyTorch users write them: strings from guides, the ``_mb`` spelling of every
size option, PyTorch keys with no meaning for the pool, and PyTorch's precedence where
settings contradict each other. Each such case warns once per process, never raises.
Pure Python; nothing here needs the compiled core."""
import warnings

import pytest

from mempool import _conf_parse
from mempool import _config as cfg
from mempool._config import ConfigWarning, OPTIONS, normalize, parse_conf, to_conf

MiB, GiB = 1 << 20, 1 << 30
SIZED = [name for name, opt in OPTIONS.items() if opt.sized]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts as a fresh process would: nothing warned yet."""
    monkeypatch.setattr(_conf_parse, "_warned", set())


def parse_warned(conf):
    """parse_conf(conf) and the messages of the ConfigWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = parse_conf(conf)
    assert all(issubclass(w.category, ConfigWarning) for w in caught), caught
    return out, [str(w.message) for w in caught]


# (conf string as a guide or an issue tracker gives it, the pool options it is read as once
# normalized (only those off their defaults), fragments of the warnings it gives, in order)
GUIDE_STRINGS = [
    # The issue's own string, from a user who mixed mempool's keys into PyTorch's syntax.
    ("backend:cuda,initial_pool_size_mb:2048,max_split_size_mb:128,expandable_segments:true",
     {"initial_pool_size": 2 * GiB, "expandable_segments": True},
     ["'expandable_segments' and 'max_split_size' (128MiB)"]),
    # PyTorch's out-of-memory message suggests it; every fine-tuning guide repeats it.
    ("max_split_size_mb:512", {"max_split_size": 512 * MiB}, []),
    ("max_split_size_mb:128", {"max_split_size": 128 * MiB}, []),
    ("expandable_segments:True", {"expandable_segments": True}, []),
    ("expandable_segments:False", {}, []),
    # Stable Diffusion web UIs.
    ("garbage_collection_threshold:0.6,max_split_size_mb:128",
     {"garbage_collection_threshold": 0.6, "max_split_size": 128 * MiB}, []),
    ("garbage_collection_threshold:0.9,max_split_size_mb:512",
     {"garbage_collection_threshold": 0.9, "max_split_size": 512 * MiB}, []),
    ("backend:cudaMallocAsync", {}, ["'backend:cudaMallocAsync' selects PyTorch's"]),
    ("backend:native", {}, ["'backend:native' selects PyTorch's own caching allocator"]),
    # PyTorch's CUDA semantics page.
    ("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
     {"roundup_power2_divisions": [1] * 9 + [2, 4] + [8] * 5}, []),
    ("roundup_power2_divisions:4", {"roundup_power2_divisions": [4] * 16}, []),
    ("pinned_use_cuda_host_register:True,pinned_num_register_threads:8", {},
     ["'pinned_use_cuda_host_register'", "'pinned_num_register_threads'"]),
    ("release_lock_on_cudamalloc:True", {}, ["'release_lock_on_cudamalloc'"]),
    ("graph_capture_record_stream_reuse:True", {"graph_capture_record_stream_reuse": True}, []),
    # Megatron-style recipes for CUDA-graph training.
    ("expandable_segments:True,graph_capture_record_stream_reuse:True",
     {"expandable_segments": True, "graph_capture_record_stream_reuse": True}, []),
    ("per_process_memory_fraction:0.9", {"limit": 0.9}, []),
    # LLM training guides: expandable segments plus the older advice.
    ("expandable_segments:True,max_split_size_mb:512", {"expandable_segments": True},
     ["'expandable_segments' and 'max_split_size' (512MiB)"]),
    ("expandable_segments:True,garbage_collection_threshold:0.8",
     {"expandable_segments": True, "garbage_collection_threshold": 0.8}, []),
    ("backend:cudaMallocAsync,expandable_segments:True,max_split_size_mb:256", {},
     ["'backend:cudaMallocAsync'",
      "backend:cudaMallocAsync ignores max_split_size_mb, expandable_segments"]),
    # Spaces after the commas and colons, as people type them.
    (" max_split_size_mb : 128 , garbage_collection_threshold : 0.6 ",
     {"max_split_size": 128 * MiB, "garbage_collection_threshold": 0.6}, []),
    ("max_non_split_rounding_mb:40,max_split_size_mb:64", {"max_split_size": 64 * MiB},
     ["'max_non_split_rounding_mb'"]),
]


@pytest.mark.parametrize("conf,options,fragments", GUIDE_STRINGS,
                         ids=[c for c, _, _ in GUIDE_STRINGS])
def test_a_string_from_a_guide_is_read_as_pytorch_reads_it(conf, options, fragments):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = normalize(parse_conf(conf))
    messages = [str(w.message) for w in caught]
    assert all(issubclass(w.category, ConfigWarning) for w in caught)
    assert len(messages) == len(fragments), messages
    for message, fragment in zip(messages, fragments):
        assert fragment in message, (fragment, message)
    changed = {k: v for k, v in full.items() if v != cfg._default(k)}
    changed.pop("backend", None)     # 'backend:cuda' is the default already
    assert changed == options


@pytest.mark.parametrize("name", SIZED)
def test_every_size_option_takes_its_mb_spelling(name):
    assert parse_conf(f"{name}_mb:64") == {name: 64 * MiB}
    assert parse_conf(f"{name}_mb: 20 ") == {name: 20 * MiB}
    # one canonical name in everything written out
    assert to_conf(parse_conf(f"backend:sim,{name}_mb:64")) == f"backend:sim,{name}:64MiB"


def test_the_sized_options_are_the_byte_counts():
    assert SIZED == ["capacity", "max_split_size", "segment_rounding", "release_threshold",
                     "limit", "initial_pool_size", "granularity", "max_map_size",
                     "min_map_size", "map_ahead"]


@pytest.mark.parametrize("name", [n for n in SIZED if n not in ("capacity", "initial_pool_size")])
def test_mb_spelling_takes_none_where_the_option_does(name):
    assert parse_conf(f"{name}_mb:none") == {name: None}


@pytest.mark.parametrize("conf,fragments", [
    ("initial_pool_size_mb:none", ["'initial_pool_size_mb'", "accepted"]),
    ("capacity_mb:0", ["'capacity_mb'", "zero"]),
    ("release_threshold_mb:1.5", ["'release_threshold_mb'", "a whole number of MB"]),
    ("limit_mb:2GB", ["'limit_mb'", "a whole number of MB"]),
    ("granularity_mb:-4", ["'granularity_mb'", "a whole number of MB"]),
    ("max_split_size_mb:10", ["'max_split_size_mb'", "below 20.00 MiB"]),
])
def test_a_bad_mb_value_is_refused_naming_the_spelling_used(conf, fragments):
    with pytest.raises(ValueError) as e:
        parse_conf(conf)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))


@pytest.mark.parametrize("alias", sorted(cfg._ALIASES))
def test_a_keyword_takes_the_canonical_name_only(alias):
    target = cfg._ALIASES[alias][0]
    with pytest.raises(ValueError, match=f"as a keyword write '{target}'"):
        normalize({alias: 64})


def test_an_unknown_key_is_still_an_error_and_suggests_the_spelling():
    with pytest.raises(ValueError, match="did you mean 'initial_pool_size_mb'"):
        parse_conf("initial_pool_sise_mb:64")
    with pytest.raises(ValueError, match="unknown option 'pinned_nonsense'"):
        parse_conf("pinned_nonsense:True")


def test_each_warning_is_given_once_per_process():
    conf = "pinned_use_background_threads:True,backend:native,limit:0.5,limit:0.6"
    first, messages = parse_warned(conf)
    assert first == {"limit": 0.6}
    assert len(messages) == 3
    again, messages = parse_warned(conf)          # default_pool(d) parses once per device
    assert again == first and messages == []
    # a key of its own gets a warning of its own
    _, messages = parse_warned("pinned_num_register_threads:4")
    assert len(messages) == 1


def test_warnings_reach_pytest_warns_as_config_warnings():
    with pytest.warns(ConfigWarning, match="'release_lock_on_hipmalloc'"):
        parse_conf("release_lock_on_hipmalloc:False")


def test_a_repeated_option_takes_the_later_value_in_either_spelling():
    out, messages = parse_warned("max_split_size:64MB,max_split_size_mb:128")
    assert out == {"max_split_size": 128 * MiB}
    assert "given twice (as 'max_split_size' and 'max_split_size_mb')" in messages[0]
    assert "the later one ('max_split_size_mb:128') wins" in messages[0]
    out, _ = parse_warned("per_process_memory_fraction:0.5,limit:8GiB")
    assert out == {"limit": 8 * GiB}


def test_expandable_segments_win_over_max_split_size_in_keywords_too():
    with pytest.warns(ConfigWarning, match="expandable segments win") as record:
        full = normalize({"expandable_segments": True, "max_split_size": "64MB"})
    assert len(record) == 1
    assert full["expandable_segments"] is True and full["max_split_size"] is None
    # and what is written out is what the pool applies
    assert to_conf({"expandable_segments": True, "max_split_size": "64MB"}) == (
        "expandable_segments:True")


def test_overridden_names_what_normalize_would_drop_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cfg.overridden({"expandable_segments": "true", "max_split_size": "64MB"}) == [
            "max_split_size"]
        assert cfg.overridden({"max_split_size": "64MB"}) == []
    assert _conf_parse._warned == set()            # a later pool with these settings still warns
    with pytest.raises(ValueError, match="'limit'"):
        cfg.overridden({"limit": "lots"})


def test_max_split_size_without_expandable_segments_is_kept():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normalize({"max_split_size": "64MB"})["max_split_size"] == 64 * MiB


def test_cuda_malloc_async_leaves_the_pools_own_options_alone():
    out, messages = parse_warned(
        "backend:cudaMallocAsync,release_threshold:1GiB,roundup_power2_divisions:4,"
        "per_process_memory_fraction:0.5")
    # what cudaMallocAsync ignores in PyTorch goes; the rest is the pool's or applies to both
    assert out == {"release_threshold": GiB, "limit": 0.5}
    assert "ignores roundup_power2_divisions" in messages[1]


def test_native_backend_keeps_the_caching_options():
    out, _ = parse_warned("backend:native,max_split_size_mb:64,expandable_segments:False")
    assert out == {"max_split_size": 64 * MiB, "expandable_segments": False}


def test_a_pytorch_backend_value_is_still_refused_as_a_keyword():
    with pytest.raises(ValueError, match="selects one of PyTorch's own allocators"):
        normalize({"backend": "cudaMallocAsync"})


def test_an_ignored_key_needs_well_formed_syntax():
    # ignored means its value is not read, not that a broken string passes
    with pytest.raises(ValueError, match="'pinned_num_register_threads' has no value"):
        parse_conf("pinned_num_register_threads")
    with pytest.raises(ValueError, match="unclosed"):
        parse_conf("graph_capture_record_stream_reuse:[True")


def test_canonical_conf_spells_every_option_one_way():
    with pytest.warns(ConfigWarning, match="'pinned_use_cuda_host_register'"):
        text = cfg.canonical_conf(
            "backend:sim,initial_pool_size_mb:2048,pinned_use_cuda_host_register:True,"
            "per_process_memory_fraction:0.5,roundup_power2_divisions:[256:1,>:4],"
            "release_threshold_mb:none")
    assert text == ("backend:sim,initial_pool_size:2GiB,limit:0.5,"
                    "roundup_power2_divisions:[256:1,>:4],release_threshold:none")
    assert parse_conf(text) == {"backend": "sim", "initial_pool_size": 2 * GiB, "limit": 0.5,
                                "roundup_power2_divisions": [1] * 9 + [4] * 7,
                                "release_threshold": None}


def test_split_pytorch_conf_keeps_what_pytorch_applies_under_the_pool():
    kept, dropped = cfg.split_pytorch_conf(
        "backend:cudaMallocAsync, pinned_use_cuda_host_register:True,expandable_segments:true,"
        "initial_pool_size_mb:64,pinned_num_register_threads:8")
    assert kept == "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    assert dropped == ["backend", "expandable_segments", "initial_pool_size_mb"]
    assert cfg.split_pytorch_conf("max_split_size_mb:64") == ("", ["max_split_size_mb"])
    assert cfg.PYTORCH_HOST_KEYS <= cfg.PYTORCH_KEYS
    assert all(k.startswith("pinned_") for k in cfg.PYTORCH_HOST_KEYS)
