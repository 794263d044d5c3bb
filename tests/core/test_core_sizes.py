"""Size policy: rounding (checked against PyTorch's formula), segment sizes, size classes."""
import pytest

import mempool
from mempool import _config

MiB = 1 << 20


def torch_round_size(size, divisions16):
    """PyTorch's CUDACachingAllocator round_size, transcribed independently."""
    kMinBlockSize = 512
    if size < kMinBlockSize:
        return kMinBlockSize
    log_size = size.bit_length() - 1
    index = min(max(log_size - 20, 0), 15)
    divisions = divisions16[index]
    if divisions > 1 and size > kMinBlockSize * divisions:
        if size & (size - 1) == 0:
            return size
        floor2 = 1 << (size.bit_length() - 1)
        step = floor2 >> (divisions.bit_length() - 1)
        if step == 0:
            return floor2 << 1
        below = size & ~(step - 1)
        return size if below == size else below + step
    return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)


SIZES = sorted({0, 1, 511, 512, 513, 1000, 4096, 65535, 65536, 1 * MiB - 1, 1 * MiB,
                1 * MiB + 1, 3 * MiB + 7, 5 * MiB, 10 * MiB - 1, 10 * MiB, 65 * MiB + 3,
                300 * MiB + 1, 700 * MiB, 1500 * MiB + 17, 3 << 30, (40 << 30) + 5}
               | {int(1.37 ** k) for k in range(1, 90)})

DIVISIONS = [0, 1, 2, 4, 8, 16, "[256:1,512:2,1024:4,>:8]", "[1:2,64:4,>:8]", "[>:4]",
             {128: 2, 1024: 8}]


@pytest.mark.parametrize("divisions", DIVISIONS, ids=str)
def test_rounding_matches_pytorch(divisions):
    divs16 = _config.parse_roundup_divisions(divisions)
    for size in SIZES:
        assert mempool.round_size(size, divisions) == torch_round_size(size, divs16), size


@pytest.mark.parametrize("size, divisions, expected", [
    (0, 0, 512), (1, 0, 512), (513, 0, 1024), (1000, 4, 1024),
    (5 * MiB + 1, 4, 6 * MiB),       # [4, 8) MiB in four steps of 1 MiB
    (5 * MiB, 4, 5 * MiB),
    (9 * MiB, 2, 12 * MiB),          # [8, 16) MiB in two steps of 4 MiB
    (9 * MiB, 0, 9 * MiB),
    (1536, 8, 1536),                 # below 512 * divisions: plain 512 B rounding
])
def test_rounding_examples(size, divisions, expected):
    assert mempool.round_size(size, divisions) == expected


def test_pool_rounds_with_its_own_divisions(sim):
    pool = sim(roundup_power2_divisions=4)
    ptr = pool.alloc(5 * MiB + 1)
    assert pool.block_info(ptr)[:2] == (6 * MiB, 5 * MiB + 1)
    pool.free(ptr)


@pytest.mark.parametrize("rounded, segment", [
    (512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB), (33 * MiB, 34 * MiB),
])
def test_segment_sizes(rounded, segment):
    assert mempool.segment_size(rounded) == segment


def test_size_classes_are_monotone_and_exact_up_to_64k():
    from mempool._core import size_class
    sizes = sorted({512 * k for k in range(1, 5000)} | {1 << k for k in range(10, 62)})
    classes = [size_class(s) for s in sizes]
    assert classes == sorted(classes)
    assert [size_class(512 * k) for k in range(1, 129)] == list(range(128))
    # Above, a class spans 1/64 of its sizes, a power of two at its top: (lo, lo + lo/64].
    for k in range(17, 40):
        lo = 1 << k
        assert size_class(lo + 512) == size_class(lo + (lo >> 6)) == size_class(lo) + 1
        assert size_class(lo + (lo >> 6) + 512) == size_class(lo) + 2
    # Past 1 TiB one last class holds every size (a stream's lists stay small).
    last = size_class((1 << 40) + 512)
    assert last == size_class(1 << 40) + 1 == size_class(1 << 61)
    assert last == size_class((1 << 40) + (1 << 34) + 512)
