"""Option parsing and validation: tables of good and bad input, PyTorch's rounding rules,
conf-string round trips. Pure Python; nothing here needs the compiled core."""
import ctypes
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempool import _conf_parse
from mempool import _config as cfg
from mempool._config import (
    OPTIONS, conf_from_env, normalize, parse_conf, parse_roundup_divisions, parse_size,
    to_conf, to_pytorch_conf,
)

from mempool._core import SMALL_SEGMENT

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
ROOT = Path(__file__).resolve().parents[2]

DEFAULTS = {
    "backend": "cuda",
    "device": 0,
    "capacity": None,
    "roundup_power2_divisions": [0] * 16,
    "max_split_size": None,
    "cross_stream_reuse": True,
    "segment_rounding": None,
    "release_threshold": None,
    "limit": None,
    "initial_pool_size": 0,
    "garbage_collection_threshold": 0.0,
    "expandable_segments": False,
    "granularity": None,
    "max_map_size": None,
    "min_map_size": None,
    "map_ahead": None,
    "graph_capture_record_stream_reuse": False,
    "ipc": None,
    "pool_handle": "create",
    "reuse_follow_event_dependencies": True,
    "reuse_allow_opportunistic": True,
    "reuse_allow_internal_dependencies": True,
}


def test_table_lists_every_option_with_a_doc():
    assert list(OPTIONS) == list(DEFAULTS)
    for name, opt in OPTIONS.items():
        assert opt.doc and opt.kind, name
        # each default passes its own parser unchanged
        default = list(opt.default) if isinstance(opt.default, tuple) else opt.default
        assert opt.parse(default, name) == default, name


def test_normalize_empty_gives_every_default():
    assert normalize({}) == DEFAULTS
    assert list(normalize({})) == list(DEFAULTS)


# --------------------------------------------------------------------------- sizes

GOOD_SIZES = [
    (0, 0),
    (512, 512),
    (1 << 62, 1 << 62),
    ("512", 512),
    ("512B", 512),
    ("512b", 512),
    ("4KB", 4 * KiB),
    ("4kb", 4 * KiB),
    ("4KiB", 4 * KiB),
    ("512MB", 512 * MiB),
    ("64mb", 64 * MiB),
    ("512MiB", 512 * MiB),
    ("2GiB", 2 * GiB),
    ("2GB", 2 * GiB),
    ("1.5GB", 3 * GiB // 2),
    (".5MB", 512 * KiB),
    ("0.5KiB", 512),
    ("1TB", TiB),
    ("3tib", 3 * TiB),
    (" 2 GB ", 2 * GiB),
    ("1.1GB", 1181116006),          # 1.1 * 2**30 = 1181116006.4, rounded down
    ("1.0", 1),
]


@pytest.mark.parametrize("value,expected", GOOD_SIZES)
def test_parse_size_good(value, expected):
    assert parse_size(value, "k") == expected


def test_parse_size_accepts_integer_like_objects():
    np = pytest.importorskip("numpy")
    assert parse_size(np.int64(4096), "k") == 4096


BAD_SIZES = [
    (-1, "negative"),
    (True, "True"),
    (False, "False"),
    (1.5, "float"),
    (1024.0, "float"),
    ("abc", "abc"),
    ("", "''"),
    ("1.5", "fraction of a byte"),
    ("1.5B", "fraction of a byte"),
    ("5XB", "unknown unit"),
    ("5 M", "unknown unit"),
    ("-5MB", "-5MB"),
    ("1e3", "1e3"),
    (None, "None"),
    ([1], "list"),
]


@pytest.mark.parametrize("value,fragment", BAD_SIZES)
def test_parse_size_bad(value, fragment):
    with pytest.raises(ValueError) as e:
        parse_size(value, "initial_pool_size")
    msg = str(e.value)
    assert "'initial_pool_size'" in msg and fragment in msg and "accepted" in msg


# --------------------------------------------------------------------------- roundup divisions

ONES_TO_8 = [1] * 9 + [2, 4] + [8] * 5

GOOD_ROUNDUP = [
    (4, [4] * 16),
    ("4", [4] * 16),
    (1, [1] * 16),
    (0, [0] * 16),                        # off; PyTorch's scalar form would refuse 0
    ("[256:1,512:2,1024:4,>:8]", ONES_TO_8),
    (" [ 256 : 1 , 512:2, 1024:4 ,>:8 ] ", ONES_TO_8),
    ("[64:8,256:4,1024:4,>:1]", [8] * 7 + [0, 4, 0, 4] + [1] * 5),
    ("[>:2]", [0] + [2] * 15),            # '>' with no key before starts at index 1
    ("[1:2,65536:4]", [2] + [0] * 14 + [4]),
    ("[2:4]", [4, 4] + [0] * 14),         # the first key fills the indices below it
    ("[>:8,256:1]", [1] * 9 + [8] * 7),   # a later key overrides, and still fills below
    ("[256:1,256:2]", [1] * 8 + [2] + [0] * 7),
    ("[131072:2]", [2] * 16),             # keys past 32 GiB clamp to the last interval
    ("[256:0,>:4]", [0] * 9 + [4] * 7),
    ("[]", [0] * 16),
    ({256: 1, 512: 2, 1024: 4, ">": 8}, ONES_TO_8),
    ({"256": 1, ">": 8}, [1] * 9 + [8] * 7),
    ({">": 8, 256: 1}, [1] * 9 + [8] * 7),  # dict order is the entry order
    (list(range(0, 1)) * 16, [0] * 16),
    ([1, 2, 4, 8] * 4, [1, 2, 4, 8] * 4),
    (tuple([16] * 16), [16] * 16),
]


@pytest.mark.parametrize("value,expected", GOOD_ROUNDUP)
def test_roundup_good(value, expected):
    assert parse_roundup_divisions(value) == expected


BAD_ROUNDUP = [
    (3, "not 0 or a power of two"),
    ("3", "not 0 or a power of two"),
    (-2, "not 0 or a power of two"),
    (True, "True"),
    (2.0, "float"),
    ("[3:2]", "not '>' or a power of two"),
    ("[0:2]", "not '>' or a power of two"),
    ("[a:2]", "not '>' or a power of two"),
    ("[256:3]", "not 0 or a power of two"),
    ("[256:x]", "not 0 or a power of two"),
    ("[256]", "not KEY:VALUE"),
    ("[256:1,,>:8]", "not KEY:VALUE"),
    ("[256:1:2]", "not KEY:VALUE"),
    ("[256:1", "[256:1"),
    ("256:1", "256:1"),
    ({">": 3}, "not 0 or a power of two"),
    ({1.5: 2}, "not '>' or a power of two"),
    ([1] * 15, "exactly 16"),
    ([1] * 15 + [3], "not 0 or a power of two"),
    (None, "NoneType"),
]


@pytest.mark.parametrize("value,fragment", BAD_ROUNDUP)
def test_roundup_bad(value, fragment):
    with pytest.raises(ValueError) as e:
        parse_roundup_divisions(value)
    msg = str(e.value)
    assert "'roundup_power2_divisions'" in msg and fragment in msg and "accepted" in msg


def _torch_roundup():
    """PyTorch's own parser and per-interval lookup (libc10), or None without torch."""
    torch = pytest.importorskip("torch")
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        lookup = lib._ZN3c1016CachingAllocator26AcceleratorAllocatorConfig24roundup_power2_divisionsEm
    except (OSError, AttributeError):
        lookup = None
    if setter is None or lookup is None:
        pytest.skip("this torch build does not expose its allocator config parser")
    lookup.restype, lookup.argtypes = ctypes.c_size_t, [ctypes.c_size_t]

    def parse(text):
        setter(f"roundup_power2_divisions:{text}")
        try:
            return [lookup(MiB << i) for i in range(16)]
        finally:
            setter("")
    return parse


TORCH_CASES = [
    "[256:1,512:2,1024:4,>:8]", "[64:8,256:4,1024:4,>:1]", "[>:2]", "[1:2,65536:4]",
    "[2:4]", "[>:8,256:1]", "[256:1,256:2]", "[131072:2]", "[256:0,>:4]", "4", "1",
    "[1:0,>:2]", "[32768:16]", "[4:2,8:0,16:4]",
]


@pytest.mark.parametrize("text", TORCH_CASES)
def test_roundup_matches_pytorch_itself(text):
    torch_parse = _torch_roundup()
    assert parse_roundup_divisions(text) == torch_parse(text)


_division = st.sampled_from([0, 1, 2, 4, 8, 16, 64])


@settings(max_examples=300, deadline=None)
@given(st.lists(_division, min_size=16, max_size=16))
def test_roundup_conf_spelling_round_trips(divs):
    text = cfg._roundup_to_conf(divs)
    if text is None:
        assert divs == [0] * 16
    else:
        assert parse_roundup_divisions(text) == divs


def test_roundup_conf_spelling_is_short_and_read_the_same_by_pytorch():
    cases = {
        tuple(ONES_TO_8): "[256:1,512:2,1024:4,>:8]",
        tuple([8] * 7 + [0, 4, 0, 4] + [1] * 5): "[64:8,256:4,1024:4,>:1]",
        tuple([0] + [2] * 15): "[1:0,>:2]",
        tuple([4] * 16): "4",
        tuple([2] + [0] * 15): "[1:2]",
    }
    for divs, text in cases.items():
        assert cfg._roundup_to_conf(list(divs)) == text
    torch_parse = _torch_roundup()
    for divs, text in cases.items():
        assert torch_parse(text) == list(divs)


# --------------------------------------------------------------------------- normalize

GOOD_OPTIONS = [
    ("backend", "sim", "sim"),
    ("backend", " host ", "host"),
    ("device", 3, 3),
    ("device", "2", 2),
    ("capacity", "80GiB", 80 * GiB),
    ("capacity", None, None),
    ("roundup_power2_divisions", "[256:1,>:8]", [1] * 9 + [8] * 7),
    ("max_split_size", "64MB", 64 * MiB),
    ("max_split_size", 20 * MiB, 20 * MiB),
    ("max_map_size", "256MiB", 256 * MiB),
    ("max_map_size", 1, 1),
    ("max_map_size", "none", None),
    ("max_split_size", None, None),
    ("max_split_size", "unlimited", None),
    ("cross_stream_reuse", False, False),
    ("cross_stream_reuse", "false", False),
    ("cross_stream_reuse", "False", False),
    ("cross_stream_reuse", "0", False),
    ("cross_stream_reuse", "true", True),
    ("cross_stream_reuse", "True", True),
    ("cross_stream_reuse", "1", True),
    ("release_threshold", "2GB", 2 * GiB),
    ("release_threshold", 0, 0),
    ("release_threshold", None, None),
    ("release_threshold", "none", None),
    ("release_threshold", "None", None),
    ("limit", 0.5, 0.5),
    ("limit", "0.5", 0.5),
    ("limit", 1.0, 1.0),
    ("limit", "1.0", 1.0),
    ("limit", ".25", 0.25),
    ("limit", 8 * GiB, 8 * GiB),
    ("limit", "8GiB", 8 * GiB),
    ("limit", "2097152", 2 * MiB),        # no decimal point: bytes
    ("limit", 2 * MiB, 2 * MiB),          # the smallest limit: one small segment
    ("limit", None, None),
    ("initial_pool_size", "1GiB", GiB),
    ("garbage_collection_threshold", 0, 0.0),
    ("garbage_collection_threshold", 0.8, 0.8),
    ("garbage_collection_threshold", "0.8", 0.8),
    ("expandable_segments", "true", True),
    ("expandable_segments", True, True),
    ("pool_handle", "default", "default"),
    ("pool_handle", "current", "current"),
    ("pool_handle", 0x7F00DEAD0000, 0x7F00DEAD0000),
    ("pool_handle", "0x10", 16),
    ("pool_handle", "4096", 4096),
    ("reuse_follow_event_dependencies", "false", False),
    ("reuse_allow_opportunistic", False, False),
    ("reuse_allow_internal_dependencies", "0", False),
]


@pytest.mark.parametrize("key,value,expected", GOOD_OPTIONS)
def test_normalize_good(key, value, expected):
    given_options = {key: value}
    out = normalize(given_options)
    assert out == {**DEFAULTS, key: expected}
    assert type(out[key]) is type(expected)
    assert given_options == {key: value}     # the input is not modified


BAD_OPTIONS = [
    ({"limit": 0}, "'limit'", "the smallest segment"),
    ({"limit": "0GB"}, "'limit'", "the smallest segment"),
    ({"limit": SMALL_SEGMENT - 1}, "'limit'", "below 2.00 MiB, the smallest segment"),
    ({"limit": -1}, "'limit'", "(negative)"),
    ({"limit": "-1"}, "'limit'", "(negative)"),
    ({"foo": 1}, "'foo'", "accepted options: backend, device"),
    ({"max_split_size_mb": 64}, "'max_split_size_mb'", "write 'max_split_size'"),
    ({"max_splt_size": 64}, "'max_splt_size'", "did you mean 'max_split_size'"),
    ({"pinned_num_register_threads": 4}, "'pinned_num_register_threads'", "no meaning here"),
    ({"backend": "gpu"}, "'backend'", "'sim', 'host' or 'cuda'"),
    ({"backend": "native"}, "'native'", "PyTorch's own allocators"),
    ({"backend": "cudaMallocAsync"}, "'cudaMallocAsync'", "PyTorch's own allocators"),
    ({"max_map_size": 0}, "'max_map_size'", "at least one page per allocation"),
    ({"max_map_size": "-1MiB"}, "'max_map_size'", "a size above 0"),
    ({"device": -1}, "'device'", "int >= 0"),
    ({"device": True}, "'device'", "int >= 0"),
    ({"device": 1.0}, "'device'", "int >= 0"),
    ({"capacity": 0}, "'capacity'", "zero"),
    ({"capacity": "lots"}, "'capacity'", "size > 0"),
    ({"cross_stream_reuse": "yes"}, "'cross_stream_reuse'", "True/False"),
    ({"cross_stream_reuse": 1}, "'cross_stream_reuse'", "True/False"),
    ({"cross_stream_reuse": None}, "'cross_stream_reuse'", "True/False"),
    ({"release_threshold": -5}, "'release_threshold'", "'none'"),
    ({"release_threshold": 0.5}, "'release_threshold'", "accepted"),
    ({"limit": 0.0}, "'limit'", "(0, 1]"),
    ({"limit": 1.5}, "'limit'", "(0, 1]"),
    ({"limit": "1.5"}, "'limit'", "(0, 1]"),
    ({"limit": "-0.5"}, "'limit'", "fraction of capacity"),
    ({"limit": True}, "'limit'", "fraction of capacity"),
    ({"limit": float("nan")}, "'limit'", "(0, 1]"),
    ({"initial_pool_size": None}, "'initial_pool_size'", "accepted"),
    ({"garbage_collection_threshold": 1.0}, "'garbage_collection_threshold'", "[0, 1)"),
    ({"garbage_collection_threshold": -0.1}, "'garbage_collection_threshold'", "[0, 1)"),
    ({"garbage_collection_threshold": "x"}, "'garbage_collection_threshold'", "[0, 1)"),
    ({"garbage_collection_threshold": True}, "'garbage_collection_threshold'", "[0, 1)"),
    ({"max_split_size": MiB}, "'max_split_size'", "below 20.00 MiB"),
    ({"max_split_size": "19MB"}, "'max_split_size'", "below 20.00 MiB"),
    ({"max_split_size": "big"}, "'max_split_size'", "at least 20 MiB"),
    ({"expandable_segments": "maybe"}, "'expandable_segments'", "True/False"),
    ({"pool_handle": "mine"}, "'pool_handle'", "'create'"),
    ({"pool_handle": 0}, "'pool_handle'", "int > 0"),
    ({"pool_handle": True}, "'pool_handle'", "int > 0"),
    ({"roundup_power2_divisions": 3}, "'roundup_power2_divisions'", "power of two"),
    ({"backend": "sim", "pool_handle": "default"}, "'pool_handle'", "backend='cuda'"),
    ({"backend": "host", "reuse_allow_opportunistic": False}, "'reuse_allow_opportunistic'",
     "backend='cuda'"),
    ({"capacity": GiB, "initial_pool_size": 2 * GiB}, "'initial_pool_size'", "'capacity'"),
    ({"limit": GiB, "initial_pool_size": 2 * GiB}, "'initial_pool_size'", "'limit'"),
    ({"capacity": 4 * GiB, "limit": 0.25, "initial_pool_size": 2 * GiB},
     "'initial_pool_size'", "'limit'"),
]


@pytest.mark.parametrize("options,key,fragment", BAD_OPTIONS)
def test_normalize_bad(options, key, fragment):
    before = dict(options)
    with pytest.raises(ValueError) as e:
        normalize(options)
    assert key in str(e.value) and fragment in str(e.value)
    assert options == before


def test_normalize_refuses_a_non_mapping():
    with pytest.raises(TypeError, match="mapping"):
        normalize("backend:sim")


def test_cuda_only_options_at_their_default_pass_on_other_backends():
    out = normalize({"backend": "sim", "pool_handle": "create",
                     "reuse_allow_opportunistic": True})
    assert out["backend"] == "sim" and out["pool_handle"] == "create"


def test_normalize_is_idempotent():
    once = normalize({"backend": "sim", "limit": "0.5", "release_threshold": "2GB",
                      "roundup_power2_divisions": "[256:1,>:8]"})
    assert normalize(once) == once


# --------------------------------------------------------------------------- conf strings

GOOD_CONFS = [
    ("", {}),
    ("   ", {}),
    ("release_threshold:2GB,max_split_size_mb:64",
     {"release_threshold": 2 * GiB, "max_split_size": 64 * MiB}),
    ("backend:sim,device:1,capacity:80GiB", {"backend": "sim", "device": 1, "capacity": 80 * GiB}),
    ("roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:True",
     {"roundup_power2_divisions": ONES_TO_8, "expandable_segments": True}),
    ("roundup_power2_divisions:4", {"roundup_power2_divisions": [4] * 16}),
    (" garbage_collection_threshold : 0.6 , limit : 0.5 ",
     {"garbage_collection_threshold": 0.6, "limit": 0.5}),
    ("per_process_memory_fraction:0.5", {"limit": 0.5}),
    ("per_process_memory_fraction:1", {"limit": 1.0}),
    ("limit:512MB,", {"limit": 512 * MiB}),                     # trailing comma, as PyTorch
    ("limit:2097152", {"limit": 2 * MiB}),
    ("max_split_size:none", {"max_split_size": None}),
    ("max_split_size_mb:20", {"max_split_size": 20 * MiB}),
    ("pool_handle:current,reuse_allow_opportunistic:false",
     {"pool_handle": "current", "reuse_allow_opportunistic": False}),
    ("cross_stream_reuse:0,initial_pool_size:1.5GiB",
     {"cross_stream_reuse": False, "initial_pool_size": 3 * GiB // 2}),
    ("backend:cuda", {"backend": "cuda"}),
]


@pytest.mark.parametrize("conf,expected", GOOD_CONFS)
def test_parse_conf_good(conf, expected):
    out = parse_conf(conf)
    assert out == expected
    assert list(out) == list(expected)


@pytest.mark.parametrize("key", sorted(cfg._PYTORCH_IGNORED))
def test_parse_conf_ignores_pytorch_keys_with_one_warning(key, monkeypatch):
    monkeypatch.setattr(_conf_parse, "_warned", set())
    with pytest.warns(cfg.ConfigWarning) as record:
        for value in ("True", "1", "[1,2]"):
            assert parse_conf(f"release_threshold:1GB,{key}:{value}") == {
                "release_threshold": GiB}
    assert len(record) == 1
    assert f"'{key}'" in str(record[0].message)
    assert "no meaning for the pool" in str(record[0].message)


def test_pytorch_keys_cover_pytorch_2_13():
    # Every key of torch 2.13's allocator config is either ours, mapped, or ignored by name.
    pytorch_keys = {
        "large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
        "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
        "pinned_use_background_threads", "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb", "backend", "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register", "release_lock_on_hipmalloc",
        "pinned_use_hip_host_register", "graph_capture_record_stream_reuse",
        "pinned_reserve_segment_size_mb", "pinned_num_register_threads",
        "per_process_memory_fraction", "pinned_free_catch_all", "throw_on_cudamalloc_oom",
    }
    handled = set(OPTIONS) | set(cfg._ALIASES) | set(cfg._PYTORCH_IGNORED)
    assert pytorch_keys <= handled
    assert cfg.PYTORCH_KEYS == pytorch_keys


BAD_CONFS = [
    ("foo:1", "'foo'", "accepted options"),
    ("release_threshold", "'release_threshold'", "has no value"),
    ("release_threshold:", "'release_threshold'", "empty value"),
    ("release_threshold:,limit:1", "'release_threshold'", "empty value"),
    (":5", "':'", "expected an option name"),
    (",limit:1", "','", "expected an option name"),
    ("limit:1:2", "limit:1", "expected ','"),
    ("limit:1[", "limit:1", "expected ','"),
    ("roundup_power2_divisions:[256:1", "'roundup_power2_divisions'", "unclosed"),
    ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[256:3]", "power of two"),
    ("max_split_size_mb:4", "max_split_size_mb:4", "below 20.00 MiB"),
    ("max_split_size_mb:64MB", "max_split_size_mb:64MB", "whole number of MB"),
    ("per_process_memory_fraction:1.5", "per_process_memory_fraction:1.5", "(0, 1]"),
    ("per_process_memory_fraction:0", "per_process_memory_fraction:0", "(0, 1]"),
    ("expandable_segments:maybe", "'expandable_segments'", "True/False"),
    ("release_threshold:2GB;limit:1", "release_threshold:2GB;limit", "expected ','"),
    ("release_threshold:2GB;", "release_threshold", "not a number with an optional unit"),
    ("release_threshold:2XB", "release_threshold", "unknown unit 'XB'"),
]


@pytest.mark.parametrize("conf,key,fragment", BAD_CONFS)
def test_parse_conf_bad(conf, key, fragment):
    with pytest.raises(ValueError) as e:
        parse_conf(conf)
    assert key in str(e.value) and fragment in str(e.value)


def test_parse_conf_refuses_a_non_string():
    with pytest.raises(TypeError, match="str"):
        parse_conf({"limit": 1})


def test_parse_conf_names_its_source():
    with pytest.raises(ValueError, match=r"^Pool.from_conf: in 'limit:2\.5'"):
        parse_conf("limit:2.5", source="Pool.from_conf")


def test_conf_from_env(monkeypatch):
    monkeypatch.delenv("MEMPOOL_CONF", raising=False)
    assert conf_from_env() == {}
    monkeypatch.setenv("MEMPOOL_CONF", "")
    assert conf_from_env() == {}
    monkeypatch.setenv("MEMPOOL_CONF", "backend:sim,release_threshold:1GiB")
    assert conf_from_env() == {"backend": "sim", "release_threshold": GiB}
    monkeypatch.setenv("MEMPOOL_CONF", "release_threshold:lots")
    with pytest.raises(ValueError, match="environment variable MEMPOOL_CONF.*release_threshold"):
        conf_from_env()
    monkeypatch.setenv("OTHER_CONF", "release_threshold:2GB,limit:lots")
    with pytest.raises(ValueError, match="OTHER_CONF.*'limit'"):
        conf_from_env("OTHER_CONF")


# --------------------------------------------------------------------------- writing confs

ROUND_TRIPS = [
    {},
    {"backend": "sim", "device": 2, "capacity": "80GiB"},
    {"backend": "sim", "roundup_power2_divisions": "[256:1,512:2,1024:4,>:8]"},
    {"backend": "sim", "roundup_power2_divisions": [0, 2] + [4] * 14},
    {"backend": "sim", "roundup_power2_divisions": 8, "max_split_size": 64 * MiB + 1},
    {"backend": "sim", "limit": 1.0},
    {"backend": "sim", "limit": 0.3, "garbage_collection_threshold": 0.7},
    {"backend": "sim", "limit": 3 * GiB + 5, "release_threshold": 0},
    {"backend": "host", "cross_stream_reuse": False, "initial_pool_size": "1.5GiB"},
    {"backend": "cuda", "pool_handle": 0x7F00DEAD0000, "reuse_allow_opportunistic": False,
     "expandable_segments": True, "release_threshold": "2GB"},
    {"pool_handle": "default", "reuse_follow_event_dependencies": False,
     "reuse_allow_internal_dependencies": False},
]


@pytest.mark.parametrize("options", ROUND_TRIPS)
def test_to_conf_round_trips(options):
    text = to_conf(options)
    assert normalize(parse_conf(text)) == normalize(options)


def test_to_conf_spelling():
    assert to_conf({}) == ""
    assert to_conf({"backend": "sim", "release_threshold": 2 * GiB, "limit": 0.5,
                    "roundup_power2_divisions": {256: 1, ">": 8}, "max_split_size": "64MB",
                    "cross_stream_reuse": False}) == (
        "backend:sim,roundup_power2_divisions:[256:1,>:8],max_split_size:64MiB,"
        "cross_stream_reuse:False,release_threshold:2GiB,limit:0.5")
    assert to_conf({"pool_handle": 4096, "initial_pool_size": 1536}) == (
        "initial_pool_size:1536,pool_handle:4096")


def test_format_size():
    assert [cfg.format_size(n) for n in (0, 1, 512, KiB, 1536, MiB, 3 * GiB, 2 * TiB, GiB + 1)] == [
        "0", "1", "512", "1KiB", "1536", "1MiB", "3GiB", "2TiB", str(GiB + 1)]


def test_to_pytorch_conf():
    assert to_pytorch_conf({}) is None
    assert to_pytorch_conf({"backend": "sim", "release_threshold": 0,
                            "cross_stream_reuse": False}) is None
    assert to_pytorch_conf({
        "backend": "sim", "max_split_size": 64 * MiB + 1, "roundup_power2_divisions": 4,
        "garbage_collection_threshold": 0.6, "limit": 0.5,
    }) == ("max_split_size_mb:64,roundup_power2_divisions:4,"
           "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5")
    assert to_pytorch_conf({"expandable_segments": True,
                            "roundup_power2_divisions": "[256:1,512:2,1024:4,>:8]"}) == (
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:True")
    # a byte limit becomes a fraction only when the capacity is known
    assert to_pytorch_conf({"backend": "sim", "capacity": 80 * GiB, "limit": 20 * GiB}) == (
        "per_process_memory_fraction:0.25")
    assert to_pytorch_conf({"backend": "sim", "limit": 20 * GiB}) is None


def test_to_pytorch_conf_is_read_back_by_pytorch():
    torch_parse = _torch_roundup()
    divs = [8] * 7 + [0, 4, 0, 4] + [1] * 5
    text = to_pytorch_conf({"roundup_power2_divisions": divs})
    assert text.startswith("roundup_power2_divisions:")
    assert torch_parse(text.split(":", 1)[1]) == divs


# --------------------------------------------------------------------------- docs


def test_docs_table_is_the_generated_one():
    doc = (ROOT / "docs" / "options.md").read_text()
    assert cfg._markdown_table() in doc


def test_every_documented_example_parses():
    for name, opt in OPTIONS.items():
        assert name in parse_conf(f"{name}:{opt.example}")
    for alias, (target, _) in cfg._ALIASES.items():
        assert target in parse_conf(f"{alias}:{cfg._alias_example(alias)}")


def test_granularity_is_the_page_of_every_backend():
    assert normalize({"backend": "sim", "granularity": "4MiB"})["granularity"] == 4 << 20
    assert parse_conf("backend:host,granularity:8MB") == {"backend": "host", "granularity": 8 << 20}
    # on cuda a multiple of the driver's granularity, which only the device can check
    assert normalize({"backend": "cuda", "granularity": "20MiB"})["granularity"] == 20 << 20


def test_limit_refusals_read_the_same_in_every_spelling():
    # Pool(limit=-1), Pool(limit="-1") and the conf string's limit:-1 give one reason, from
    # one place; a conf string only says where it came from first.
    reasons = []
    for call in (lambda: cfg.normalize({"limit": -1}), lambda: cfg.normalize({"limit": "-1"}),
                 lambda: cfg.parse_conf("limit:-1")):
        with pytest.raises(ValueError) as info:
            call()
        reasons.append(str(info.value).split("option 'limit': ", 1)[1].split(" is not", 1)[1])
    assert len(set(reasons)) == 1, reasons


def test_an_equals_sign_is_answered_with_the_colon_spelling():
    with pytest.raises(ValueError) as info:
        cfg.parse_conf("expandable_segments=True")
    text = str(info.value)
    assert "write expandable_segments:True " in text and "VALUE" not in text, text


def test_conf_parsing_is_linear_in_repeats(monkeypatch):
    # A repeated key is warned once; its message (which quotes the string) is built once,
    # not once a repeat: 16k repeats and a 1 MB string are as cheap a key as one.
    built = []
    shown = cfg._shown
    monkeypatch.setattr(_conf_parse, "_shown", lambda conf: built.append(len(conf)) or shown(conf))
    monkeypatch.setattr(_conf_parse, "_warned", set())
    with pytest.warns(cfg.ConfigWarning, match="given twice"):
        assert cfg.parse_conf(",".join(["release_threshold:1"] * 16384)) == \
            {"release_threshold": 1}
    assert len(built) == 1
    monkeypatch.setattr(_conf_parse, "_warned", set())
    big = ",".join(["limit:4MiB", "limit_mb:4"] * ((1 << 20) // 22))
    assert len(big) > 1 << 19
    with pytest.warns(cfg.ConfigWarning, match="given twice") as caught:
        assert cfg.parse_conf(big) == {"limit": 4 * MiB}
    assert len(built) == 2 and len(caught) == 1
    assert len(str(caught[0].message)) < 1000          # the string is quoted cut short
