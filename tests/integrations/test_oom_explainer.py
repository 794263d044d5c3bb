"""One OOM explainer for the Pool and PyTorch (Note [One OOM explainer], core/mp_oom.c).

The rules (what refused, whether free memory is fragmented, which option would help) are
one table in the core. They are checked here three ways: the table itself on hand-made
records, then each case built on `sim` and refused twice, through Pool.alloc (the Pool's
OutOfMemoryError) and through the table the C++ PyTorch allocator reports with
(oom_message, tests/integrations/test_torch_api_table.py); the two messages must be the same text but
for the names of the options. The glue's sources must reach the rules only through the
table: no copy of them may come back there.
"""
import ctypes
import re
from pathlib import Path

import pytest

import mempool
import mempool._units
from mempool import _core
from _core_config import Config
from _support import MiB
from test_torch_api_table import DEVICE, Api, OomRecord

core = ctypes.CDLL(_core.__file__)
UNLIMITED = (1 << 64) - 1
MAX_ALLOC = 1 << 62
MP_ENOMEM, MP_ELIMIT, MP_EUPSTREAM = 1, 2, 8
BY_DEVICE, BY_LIMIT, BY_MAX_ALLOC, BY_UPSTREAM = range(4)
(NONE, FREE_MEMORY, RAISE_LIMIT, EXPANDABLE, EXPANDABLE_OR_LIMIT, MAX_SPLIT, REDUCE_REQUEST,
 CAPTURE) = range(8)


class Diagnosis(ctypes.Structure):
    _fields_ = [("refused_by", ctypes.c_int), ("advice", ctypes.c_int),
                ("fragmented", ctypes.c_int)]


core.mp_oom_explain.argtypes = [ctypes.POINTER(OomRecord), ctypes.POINTER(Config),
                                ctypes.POINTER(Diagnosis)]
core.mp_format_bytes.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p,
                                 ctypes.c_size_t]
core.mp_format_bytes.restype = ctypes.c_size_t


def explain(code=MP_ENOMEM, nbytes=4 * MiB, rounded=None, cached=0, largest=0,
            capturing=0, expandable=0, max_split=UNLIMITED):
    rec = OomRecord(code=code, nbytes=nbytes, rounded=rounded or nbytes, cached_bytes=cached,
                    largest_free_block=largest, capturing=capturing, limit=UNLIMITED)
    cfg = Config(max_split_size=max_split, expandable_segments=expandable)
    d = Diagnosis()
    core.mp_oom_explain(ctypes.byref(rec), ctypes.byref(cfg), ctypes.byref(d))
    return d.refused_by, d.advice, d.fragmented


# (what the record and options say) -> (refused by, advice, fragmented)
TABLE = [
    (dict(), (BY_DEVICE, FREE_MEMORY, 0)),
    (dict(code=MP_ELIMIT), (BY_LIMIT, RAISE_LIMIT, 0)),
    # Enough cached for the block, none big enough: fragmentation.
    (dict(cached=10 * MiB, largest=2 * MiB), (BY_DEVICE, EXPANDABLE, 1)),
    (dict(code=MP_ELIMIT, cached=10 * MiB, largest=2 * MiB), (BY_LIMIT, EXPANDABLE_OR_LIMIT, 1)),
    # The rounded block decides, not the bytes asked for.
    (dict(nbytes=3 * MiB, rounded=4 * MiB, cached=3 * MiB, largest=2 * MiB),
     (BY_DEVICE, FREE_MEMORY, 0)),
    # Fragmented with expandable segments already on: nothing to merge-advise.
    (dict(cached=10 * MiB, largest=2 * MiB, expandable=1), (BY_DEVICE, FREE_MEMORY, 1)),
    (dict(cached=10 * MiB, largest=2 * MiB, expandable=1, max_split=8 * MiB),
     (BY_DEVICE, MAX_SPLIT, 1)),
    (dict(cached=10 * MiB, largest=8 * MiB, max_split=8 * MiB), (BY_DEVICE, MAX_SPLIT, 0)),
    (dict(nbytes=1 << 63, rounded=1 << 63), (BY_MAX_ALLOC, REDUCE_REQUEST, 0)),
    (dict(capturing=1), (BY_DEVICE, CAPTURE, 0)),
    (dict(code=MP_ELIMIT, capturing=1, cached=10 * MiB, largest=2 * MiB),
     (BY_LIMIT, CAPTURE, 1)),
    (dict(code=MP_EUPSTREAM), (BY_UPSTREAM, NONE, 0)),
]


@pytest.mark.parametrize("given, expected", TABLE)
def test_the_table_of_cases(given, expected):
    assert explain(**given) == expected


@pytest.mark.parametrize("n, exact", [(0, False), (1, False), (512, False), (1023, False),
                                      (1024, True), (3000, True), (20 * MiB, False),
                                      (4_284_481_536, True), (1 << 40, True), (1 << 63, False),
                                      (UNLIMITED, True)])
def test_byte_counts_are_spelled_as_python_spells_them(n, exact):
    buf = ctypes.create_string_buffer(96)
    core.mp_format_bytes(n, exact, buf, len(buf))
    assert buf.value.decode() == mempool._units.format_bytes(n, exact=exact)


# ------------------------------------------------------------ both front ends, on sim

TORCH_WORDS = [("expandable_segments=True", "expandable_segments:True in MEMPOOL_CONF"),
               ("raise 'limit'", "raise the limit (set_per_process_memory_fraction or the "
                                 "pool's 'limit')"),
               ("set 'limit' on other pools sharing the device",
                "cap other processes on the device"),
               (f"sim device {DEVICE}", f"cuda device {DEVICE}")]


def in_torch_words(message):
    for pool_words, torch_words in TORCH_WORDS:
        message = message.replace(pool_words, torch_words)
    return message


def fragmented(pool):
    ptrs = [pool.alloc(2 * MiB) for _ in range(10)]   # one 20 MiB segment
    for p in ptrs[::2]:
        pool.free(p)


def device_full(pool):
    pool.alloc(30 * MiB)
    pool.device.fail_next(3)


# name -> (pool options, setup, request, what the message must hold)
CASES = {
    "device": (dict(capacity="100MiB"), device_full, 3000,
               "refused by sim device 7 (capacity 100.00 MiB)", FREE_MEMORY),
    "limit": (dict(capacity="1GiB", limit="40MiB"), lambda p: p.alloc(24 * MiB), 20 * MiB,
              "refused by the pool's limit of 40.00 MiB", RAISE_LIMIT),
    "fragmented": (dict(capacity="20MiB"), fragmented, 4 * MiB,
                   "free memory is fragmented (10.00 MiB cached, but no free block holds "
                   "4.00 MiB)", EXPANDABLE),
    "fragmented under a limit": (dict(limit="20MiB"), fragmented, 4 * MiB,
                                 "lets free neighbours merge, or raise", EXPANDABLE_OR_LIMIT),
    "too large": (dict(), lambda p: None, 1 << 63, "refused by the largest request accepted",
                  REDUCE_REQUEST),
}


@pytest.fixture
def api():
    return Api.from_address(_core._torch_api_address())


@pytest.mark.parametrize("case", CASES)
def test_the_pool_and_pytorch_explain_a_refusal_alike(api, case):
    options, setup, nbytes, holds, advice = CASES[case]
    pool = mempool.Pool(backend="sim", device=DEVICE, **options)
    setup(pool)
    stream = 5
    with pytest.raises(mempool.OutOfMemoryError) as err:
        pool.alloc(nbytes, stream)
    by_pool = str(err.value)
    assert holds in by_pool
    # The same refusal through the table the PyTorch glue reports with.
    if case == "device":
        pool.device.fail_next(3)
    _core._torch_register(DEVICE, pool)
    try:
        out = ctypes.c_uint64()
        rc = api.alloc(DEVICE, nbytes, stream, ctypes.byref(out))
        assert rc in (MP_ENOMEM, MP_ELIMIT)
        rec = OomRecord()
        buf = ctypes.create_string_buffer(1024)
        assert api.oom_message(DEVICE, None, rc, nbytes, stream, ctypes.byref(rec), buf,
                               len(buf)) == 0
    finally:
        _core._torch_unregister(DEVICE)
    assert buf.value.decode() == in_torch_words(by_pool)
    assert (rec.nbytes, rec.code, rec.used_bytes) == (nbytes, rc, pool.used_bytes())
    cfg = Config(max_split_size=UNLIMITED, expandable_segments=0)
    d = Diagnosis()
    core.mp_oom_explain(ctypes.byref(rec), ctypes.byref(cfg), ctypes.byref(d))
    assert d.advice == advice


# ------------------------------------------------------------ no second copy in the glue

GLUE = Path(__file__).resolve().parents[2] / "mempool" / "_csrc" / "glue"


def glue_sources():
    return {p.name: re.sub(r"//[^\n]*|/\*.*?\*/", "", p.read_text(), flags=re.S)
            for p in sorted(GLUE.glob("*")) if p.suffix in (".c", ".cpp", ".h", ".inc")}


def test_the_pytorch_glue_explains_through_the_core():
    sources = glue_sources()
    code = "\n".join(sources.values())
    assert "api->oom_message(" in code, "the C++ allocator no longer asks the core"
    assert "mp_oom_message(" in sources["mp_torch_api.c"]
    # The rules live in mp_oom_explain only: no test of cached bytes against a request, and
    # no hint of the glue's own.
    assert not re.search(r"cached\w*\s*>=", code)
    assert "free memory is fragmented" not in code and "lets free neighbours merge" not in code
