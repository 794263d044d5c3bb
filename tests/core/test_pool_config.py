"""Configuration through the Pool: Pool.from_conf in PyTorch's PYTORCH_CUDA_ALLOC_CONF
syntax, Pool keywords, and mempool.default_pool() from MEMPOOL_CONF.

mempool/_config.py has its own parser tests; these check that what a conf string says
reaches the pool (its options, and its behaviour), and that a bad string is refused with
a message naming the key, the value and what is accepted.
"""
import pytest

import mempool
from mempool import _config
from _support import BASE, GiB, MiB, gpu_available


def run_script(pool):
    """A fixed allocate/free sequence; returns what the pool looks like after it."""
    ptrs = [pool.alloc(n) for n in (3000, 5 * MiB, 12 * MiB, 30 * MiB)]
    pool.free(ptrs[2])
    pool.free(ptrs[0])
    ptrs.append(pool.alloc(7 * MiB))
    pool.free(ptrs[1])
    layout = pool.layout()
    stats = pool.stats()
    for p in (ptrs[3], ptrs[4]):
        pool.free(p)
    return layout, stats


# --------------------------------------------------------------------------- good strings

GOOD = [
    ("backend:sim", {}),
    ("backend:sim,device:3", {"device": 3}),
    ("backend:host,capacity:64MiB", {"backend": "host", "capacity": 64 * MiB}),
    ("backend:sim,capacity:1GiB,limit:0.5", {"capacity": GiB, "limit": 512 * MiB}),
    ("backend:sim,capacity:1GiB,per_process_memory_fraction:0.25",
     {"capacity": GiB, "limit": 256 * MiB}),
    ("backend:sim,limit:300MB", {"limit": 300 * MiB}),
    ("backend:sim,limit:1073741824", {"limit": GiB}),
    ("backend:sim,limit:none", {"limit": None}),
    ("backend:sim,release_threshold:2GB", {"release_threshold": 2 * GiB}),
    ("backend:sim,release_threshold:0", {"release_threshold": 0}),
    ("backend:sim,release_threshold:unlimited", {"release_threshold": None}),
    ("backend:sim,initial_pool_size:64MiB", {"initial_pool_size": 64 * MiB}),
    ("backend:sim,initial_pool_size:1.5GiB", {"initial_pool_size": 1536 * MiB}),
    ("backend:sim,max_split_size_mb:64", {"max_split_size": 64 * MiB}),
    ("backend:sim,max_split_size:64MB", {"max_split_size": 64 * MiB}),
    ("backend:sim,garbage_collection_threshold:0.8", {"garbage_collection_threshold": 0.8}),
    ("backend:sim,expandable_segments:True", {"expandable_segments": True}),
    ("backend:sim,expandable_segments:true", {"expandable_segments": True}),
    ("backend:sim,expandable_segments:1", {"expandable_segments": True}),
    ("backend:sim,expandable_segments:False", {"expandable_segments": False}),
    ("backend:sim,cross_stream_reuse:False", {"cross_stream_reuse": False}),
    ("backend:sim,roundup_power2_divisions:4", {"roundup_power2_divisions": [4] * 16}),
    ("backend:sim,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
     {"roundup_power2_divisions": [1] * 9 + [2, 4] + [8] * 5}),
    (" backend : sim , release_threshold : 1 GiB , limit : 0.5 ",
     {"release_threshold": GiB, "limit": 40 * GiB}),
]


@pytest.mark.parametrize("conf, expected", GOOD, ids=[c for c, _ in GOOD])
def test_a_conf_string_sets_the_pool_options(conf, expected):
    pool = mempool.Pool.from_conf(conf)
    # Every option not named keeps its default.
    want = mempool.Pool(backend=expected.get("backend", "sim"),
                        capacity=expected.get("capacity")).options
    want.update(expected)
    assert pool.options == want
    assert pool.backend == want["backend"] and pool.device_id == want["device"]
    pool.check_invariants()


def test_conf_values_reach_the_core():
    pool = mempool.Pool.from_conf("backend:sim,capacity:1GiB,max_split_size_mb:64,"
                                  "roundup_power2_divisions:4,initial_pool_size:16MiB")
    assert pool.capacity == GiB
    assert pool.stats()["max_split_size"] == 64 * MiB
    assert pool.reserved_bytes() == 16 * MiB        # reserved at creation
    ptr = pool.alloc(5 * MiB + 1)                   # [4, 8) MiB in four steps of 1 MiB
    assert pool.block_info(ptr)[:2] == (6 * MiB, 5 * MiB + 1)
    assert ptr == BASE                              # out of the initial reservation
    pool.free(ptr)


@pytest.mark.parametrize("name", [n for n, o in _config.OPTIONS.items() if not o.cuda_only])
def test_every_pool_keyword_is_a_conf_key_with_the_same_meaning(name):
    example = _config.OPTIONS[name].example
    if name == "backend":
        by_conf = mempool.Pool.from_conf("backend:sim")
        by_keyword = mempool.Pool(backend="sim")
    else:
        by_conf = mempool.Pool.from_conf(f"backend:sim,{name}:{example}")
        by_keyword = mempool.Pool(backend="sim", **{name: example})
    assert by_conf.options == by_keyword.options
    if name not in ("backend", "device"):    # the example differs from the default
        assert by_conf.options[name] != mempool.Pool(backend="sim").options[name]


def test_a_pool_from_conf_behaves_as_the_same_pool_from_keywords():
    conf = ("backend:sim,capacity:100MiB,release_threshold:20MiB,limit:0.6,"
            "initial_pool_size:10MiB,garbage_collection_threshold:0.4,"
            "roundup_power2_divisions:[1:2,>:4]")
    by_conf = mempool.Pool.from_conf(conf)
    by_keyword = mempool.Pool(backend="sim", capacity=100 * MiB, release_threshold=20 * MiB,
                              limit=0.6, initial_pool_size=10 * MiB,
                              garbage_collection_threshold=0.4,
                              roundup_power2_divisions={1: 2, ">": 4})
    layout, stats = run_script(by_conf)
    assert (layout, stats) == run_script(by_keyword)
    # ... and the options did something: a default pool ends elsewhere.
    assert (layout, stats) != run_script(mempool.Pool(backend="sim", capacity=100 * MiB))


def test_sizes_as_ints_and_strings_are_the_same():
    a = mempool.Pool(backend="sim", release_threshold=3 * MiB, initial_pool_size=4 * MiB)
    b = mempool.Pool(backend="sim", release_threshold="3MiB", initial_pool_size="4MB")
    c = mempool.Pool.from_conf("backend:sim,release_threshold:3145728,initial_pool_size:4MiB")
    assert a.options == b.options == c.options


def test_keyword_overrides_win_over_the_string():
    pool = mempool.Pool.from_conf("backend:cuda,limit:0.5,release_threshold:1GiB",
                                  backend="sim", limit="1GiB")
    assert (pool.backend, pool.options["limit"], pool.options["release_threshold"]) == \
        ("sim", GiB, GiB)


# PyTorch allocator strings as users have them: PyTorch's own parser takes each, and so
# does from_conf, unchanged (the backend given apart: PyTorch's conf has no sim or host).
PYTORCH_CONFS = [
    ("max_split_size_mb:128,garbage_collection_threshold:0.6",
     {"max_split_size": 128 * MiB, "garbage_collection_threshold": 0.6}),
    ("expandable_segments:True", {"expandable_segments": True}),
    ("roundup_power2_divisions:[256:1,512:2,1024:4,>:8],garbage_collection_threshold:0.7",
     {"roundup_power2_divisions": [1] * 9 + [2, 4] + [8] * 5,
      "garbage_collection_threshold": 0.7}),
    ("max_split_size_mb:64,roundup_power2_divisions:4",
     {"max_split_size": 64 * MiB, "roundup_power2_divisions": [4] * 16}),
    ("per_process_memory_fraction:0.5", {"limit": 40 * GiB}),
]


@pytest.mark.parametrize("conf, expected", PYTORCH_CONFS, ids=[c for c, _ in PYTORCH_CONFS])
def test_a_pytorch_alloc_conf_is_accepted_as_is(conf, expected):
    torch = pytest.importorskip("torch")
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    # With CUDA, PyTorch's setter reconfigures the live caching allocator: only its CPU
    # build is used as a parser here.
    if setter is not None and not torch.cuda.is_available():
        try:
            setter(conf)                     # PyTorch's parser reads it without complaint
        finally:
            setter("")
    pool = mempool.Pool.from_conf(conf, backend="sim")
    assert {k: pool.options[k] for k in expected} == expected


# --------------------------------------------------------------------------- bad strings

# (conf, fragments the message must hold: the key, the value, what is accepted)
BAD = [
    ("backend:sim,bogus:1", ["unknown option 'bogus'", "accepted options: backend, device"]),
    ("backend:sim,release_thresold:1GB", ["'release_thresold'", "did you mean 'release_threshold'"]),
    ("backend:sim,release_threshold:lots",
     ["'release_threshold'", "'lots'", "accepted: an int >= 0 (bytes) or a string"]),
    ("backend:sim,release_threshold:-1", ["'release_threshold'", "'-1'", "accepted"]),
    ("backend:sim,limit:1.5", ["'limit'", "'1.5'", "accepted", "(0, 1]"]),
    ("backend:sim,limit:0.0", ["'limit'", "'0.0'", "(0, 1]"]),
    ("backend:sim,per_process_memory_fraction:2", ["'per_process_memory_fraction'", "'2'",
                                                   "a fraction of device memory in (0, 1]"]),
    ("backend:sim,garbage_collection_threshold:1.0",
     ["'garbage_collection_threshold'", "'1.0'", "accepted: a float in [0, 1)"]),
    ("backend:sim,garbage_collection_threshold:high", ["'garbage_collection_threshold'", "'high'"]),
    ("backend:sim,max_split_size_mb:10", ["'max_split_size_mb'", "below 20.00 MiB",
                                          "accepted: a size of at least 20 MiB"]),
    ("backend:sim,max_split_size_mb:64MB", ["'max_split_size_mb'", "'64MB'",
                                            "a whole number of MB"]),
    ("backend:sim,expandable_segments:yes", ["'expandable_segments'", "'yes'",
                                             "True/False"]),
    ("backend:sim,initial_pool_size:lots", ["'initial_pool_size'", "'lots'", "accepted"]),
    ("backend:sim,device:-1", ["'device'", "'-1'", "an int >= 0"]),
    ("backend:gpu", ["'backend'", "'gpu'", "'sim', 'host' or 'cuda'"]),
    ("backend:sim,roundup_power2_divisions:3", ["'roundup_power2_divisions'", "power of two"]),
    # Contradictions between mempool's own options.
    ("backend:sim,pool_handle:default", ["'pool_handle'", "only to backend='cuda'"]),
    ("backend:sim,capacity:32MiB,initial_pool_size:64MiB", ["'initial_pool_size'", "exceeds 'capacity'"]),
    ("backend:sim,limit:16MiB,initial_pool_size:32MiB", ["'initial_pool_size'", "exceeds 'limit'"]),
    # Syntax.
    ("backend:sim,limit", ["'limit' has no value"]),
    ("backend:sim,limit:", ["'limit' has an empty value"]),
    ("backend:sim,,limit:0.5", ["expected an option name"]),
    ("backend:sim,roundup_power2_divisions:[256:1", ["unclosed '['"]),
]


@pytest.mark.parametrize("conf, fragments", BAD, ids=[c for c, _ in BAD])
def test_a_bad_conf_string_is_refused_naming_key_value_and_what_is_accepted(conf, fragments):
    with pytest.raises(ValueError) as err:
        mempool.Pool.from_conf(conf)
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


@pytest.mark.parametrize("options, fragments", [
    ({"bogus": 1}, ["unknown option 'bogus'"]),
    ({"max_split_size_mb": 64}, ["'max_split_size_mb'", "as a keyword write 'max_split_size'"]),
    ({"release_threshold": "lots"}, ["'release_threshold'", "'lots'", "accepted"]),
    ({"release_threshold": 1.5}, ["'release_threshold'", "1.5", "a float is not a size"]),
    ({"limit": 2.0}, ["'limit'", "2.0", "(0, 1]"]),
    ({"garbage_collection_threshold": -0.1}, ["'garbage_collection_threshold'", "-0.1"]),
    ({"expandable_segments": "maybe"}, ["'expandable_segments'", "'maybe'"]),
    ({"initial_pool_size": -5}, ["'initial_pool_size'", "-5", "negative"]),
])
def test_a_bad_keyword_is_refused_the_same_way(options, fragments):
    with pytest.raises(ValueError) as err:
        mempool.Pool(backend="sim", **options)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_a_refused_change_on_a_live_pool_changes_nothing(sim):
    pool = sim(limit="40MiB", release_threshold="8MiB")
    before = dict(pool.options)
    with pytest.raises(ValueError, match="'limit'"):
        pool.set_limit("forty")
    with pytest.raises(ValueError, match="'release_threshold'"):
        pool.set_release_threshold(-1)
    assert pool.options == before
    a = pool.alloc(30 * MiB)
    with pytest.raises(mempool.OutOfMemoryError, match=r"limit of 40.00 MiB \(41,943,040 bytes\)"):
        pool.alloc(12 * MiB)                 # the old limit still holds
    pool.free(a)


# --------------------------------------------------------------------------- MEMPOOL_CONF


@pytest.fixture
def fresh_default_pools(monkeypatch):
    """An empty registry of default pools, restored afterwards."""
    monkeypatch.setattr(mempool, "_default_pools", {})
    return monkeypatch


def test_default_pool_is_built_from_mempool_conf(fresh_default_pools):
    fresh_default_pools.setenv("MEMPOOL_CONF", "backend:sim,capacity:1GiB,limit:0.5,"
                                               "release_threshold:0,max_split_size_mb:64")
    pool = mempool.default_pool(device=2)
    assert (pool.backend, pool.device_id, pool.capacity) == ("sim", 2, GiB)
    assert pool.options["limit"] == 512 * MiB and pool.options["max_split_size"] == 64 * MiB
    assert mempool.default_pool(device=2) is pool           # one per device
    assert mempool.default_pool(device=3) is not pool
    pool.free(pool.alloc(MiB))
    assert pool.reserved_bytes() == 0                       # release_threshold:0 in force


def test_default_pool_without_mempool_conf(fresh_default_pools):
    fresh_default_pools.delenv("MEMPOOL_CONF", raising=False)
    pool = mempool.default_pool()
    assert pool.backend == ("cuda" if gpu_available() else "sim")
    assert pool.options["release_threshold"] is None and pool.options["limit"] is None


def test_a_bad_mempool_conf_names_the_variable_key_and_value(fresh_default_pools):
    fresh_default_pools.setenv("MEMPOOL_CONF", "backend:sim,release_threshold:lots")
    with pytest.raises(ValueError) as err:
        mempool.default_pool(device=1)
    msg = str(err.value)
    assert "environment variable MEMPOOL_CONF" in msg
    assert "'release_threshold'" in msg and "'lots'" in msg and "accepted" in msg
    assert mempool._default_pools == {}                     # nothing half-made was kept
    fresh_default_pools.setenv("MEMPOOL_CONF", "backend:sim")
    assert mempool.default_pool(device=1).backend == "sim"


@pytest.mark.parametrize("bad", [True, 1.0, -1, "one"])
def test_default_pool_device_is_an_ordinal(monkeypatch, bad):
    monkeypatch.setenv("MEMPOOL_CONF", "backend:sim")
    with pytest.raises((TypeError, ValueError), match="device"):
        mempool.default_pool(bad)


def test_default_pool_is_one_per_ordinal(monkeypatch):
    monkeypatch.setenv("MEMPOOL_CONF", "backend:sim")
    monkeypatch.setattr(mempool, "_default_pools", {})
    assert mempool.default_pool("3") is mempool.default_pool(3)
    assert mempool.default_pool(3).device_id == 3


def test_a_bad_option_raises_mempool_option_error_a_value_error_naming_the_option():
    assert "OptionError" in mempool.__all__
    with pytest.raises(mempool.OptionError, match=r"option 'backend': 'simm' is not valid; "
                                                  r"accepted: 'sim', 'host' or 'cuda'") as info:
        mempool.Pool(backend="simm")
    assert isinstance(info.value, ValueError)
    with pytest.raises(mempool.OptionError, match=r"option 'keep': -5 is not valid \(negative\)"):
        mempool.Pool(backend="sim").trim(keep=-5)


def test_an_option_error_crosses_processes_whole():
    import pickle

    with pytest.raises(mempool.OptionError) as info:
        mempool.Pool(backend="sim", release_threshold="4XB")
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is mempool.OptionError
    assert str(again) == str(info.value)
    assert again.why == info.value.why == "unknown unit 'XB'"
