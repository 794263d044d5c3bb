"""Hostile handle bytes (Note [Sharing across processes], core/mp_share.c): truncated,
flipped, of another backend, with huge lengths. Every one is a ValueError (or, for a flip the
model cannot tell from a real handle, a clean import), never a crash, and a refused import
changes nothing: no mapping is left open, no ledger hold taken."""
import struct

import pytest

import mempool

MiB = 1 << 20


def make(backend, **options):
    options.setdefault("capacity", "64MiB")
    if backend == "host":
        options["ipc"] = True
    return mempool.Pool(backend, **options)


def state(producer, consumer):
    """What a refused import must leave as it was."""
    counters = consumer.device.counters()
    return (consumer.layout(), consumer.used_bytes(), counters.get("open_imports"),
            producer.layout(), producer.collect_shared())


@pytest.fixture(params=["sim", "host"])
def pair(request):
    producer, consumer = make(request.param), make(request.param)
    ptr = producer.alloc(MiB)
    handle = producer.export(ptr)
    consumer.import_(handle).close()          # claimed and released: the slot stays live
    yield producer, consumer, handle
    producer.free(ptr)


def test_truncated_handles_are_value_errors(pair):
    producer, consumer, handle = pair
    data = bytes(handle)
    before = state(producer, consumer)
    for n in range(len(data)):
        with pytest.raises(ValueError):
            consumer.import_(mempool.SharedHandle.from_bytes(data[:n]))
    assert state(producer, consumer) == before


def test_longer_handles_are_value_errors(pair):
    producer, consumer, handle = pair
    with pytest.raises(ValueError):
        mempool.SharedHandle.from_bytes(bytes(handle) + b"\0")
    with pytest.raises(ValueError, match="more than any handle"):
        mempool.SharedHandle.from_bytes(b"MPSX" + bytes(1 << 20))


def test_every_flipped_byte_is_refused_or_opens_cleanly(pair):
    producer, consumer, handle = pair
    data = bytes(handle)
    refused = 0
    for i in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            hostile = bytearray(data)
            hostile[i] ^= mask
            try:
                buf = consumer.import_(mempool.SharedHandle.from_bytes(bytes(hostile)))
            except ValueError:
                refused += 1
                continue
            buf.close()   # a flip the model cannot tell from a real handle (e.g. the base)
            consumer.check_invariants()
    assert refused > len(data)
    assert consumer.device.counters().get("open_imports") in (0, None)
    assert consumer.used_bytes() == 0
    producer.check_invariants()


def _with_fields(data, **changes):
    """The handle's bytes with fields of its header (tests/_share layout) replaced."""
    magic, version, namelen = struct.unpack_from("<4sBB", data)
    at = 6 + namelen
    fields = list(struct.unpack_from("<IQQQQI", data, at))
    names = ["slot", "generation", "ticket", "offset", "nbytes", "region_len"]
    for name, value in changes.items():
        fields[names.index(name)] = value
    return data[:at] + struct.pack("<IQQQQI", *fields) + data[at + struct.calcsize("<IQQQQI"):]


@pytest.mark.parametrize("field,value", [
    ("nbytes", 1 << 63), ("offset", 1 << 63), ("nbytes", 0), ("region_len", 1 << 31),
    ("region_len", 3), ("slot", 1 << 31), ("generation", 1 << 60)])
def test_huge_or_wrong_fields_are_value_errors(pair, field, value):
    producer, consumer, handle = pair
    before = state(producer, consumer)
    with pytest.raises(ValueError):
        consumer.import_(mempool.SharedHandle.from_bytes(_with_fields(bytes(handle),
                                                                      **{field: value})))
    assert state(producer, consumer) == before


def test_huge_region_sizes_are_refused_by_the_core(pair):
    producer, consumer, handle = pair
    region = bytearray(handle.region)
    namelen = region[5]
    at = 6 + namelen + 8 + 8                  # the region's bytes: after device, pid, base
    before = state(producer, consumer)
    for size in (1 << 62, (1 << 64) - 512, 512 * 3 + 1):
        region[at:at + 8] = size.to_bytes(8, "little")
        data = bytes(handle)
        data = data[:len(data) - len(region)] + bytes(region)
        data = _with_fields(data, offset=0, nbytes=512)
        with pytest.raises(ValueError):
            consumer.import_(mempool.SharedHandle.from_bytes(data))
    assert state(producer, consumer) == before


def test_a_region_whose_payload_length_disagrees_is_refused_before_any_import(pair):
    # The region's header is read by the core's own parser (mp_share_region), so from_bytes
    # refuses what mp_share_open would, before a pool is asked to open anything.
    producer, consumer, handle = pair
    for region in (handle.region + b"\0", handle.region[:-1]):
        data = bytes(handle)
        data = data[:len(data) - len(handle.region)] + region
        with pytest.raises(ValueError, match="not one mempool made"):
            mempool.SharedHandle.from_bytes(_with_fields(data, region_len=len(region)))


def test_a_handle_of_another_backend_is_refused():
    sim, host = make("sim"), make("host")
    sim_handle = sim.export(sim.alloc(4096))
    host_handle = host.export(host.alloc(4096))
    with pytest.raises(ValueError, match="'sim'.*'host'"):
        host.import_(sim_handle)
    with pytest.raises(ValueError, match="'host'.*'sim'"):
        sim.import_(host_handle)
    # The region's own header names its upstream too: spliced into a handle of the other
    # backend's ledger, the core refuses it.
    spliced = bytes(sim_handle)[:len(bytes(sim_handle)) - len(sim_handle.region)]
    spliced = _with_fields(spliced + host_handle.region, region_len=len(host_handle.region),
                           offset=0, nbytes=4096)
    with pytest.raises(ValueError):
        sim.import_(mempool.SharedHandle.from_bytes(spliced))
    assert sim.device.counters()["open_imports"] == 0


def test_random_bytes_never_crash():
    import random
    consumer = make("sim")
    rng = random.Random(54)
    for _ in range(2000):
        data = b"MPSX\x01" + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        try:
            consumer.import_(mempool.SharedHandle.from_bytes(data))
        except ValueError:
            pass
    assert consumer.device.counters()["open_imports"] == 0
    consumer.check_invariants()


def test_a_region_of_another_format_version_is_refused_naming_it(pair):
    producer, consumer, handle = pair
    region = bytearray(handle.region)
    region[4] ^= 3                            # the format's version byte, after "MPSH"
    data = bytes(handle)
    data = data[:len(data) - len(region)] + bytes(region)
    with pytest.raises(ValueError, match="another version of mempool"):
        mempool.SharedHandle.from_bytes(data)


def test_a_host_payload_of_the_former_layout_is_refused():
    # The former host payload (one descriptor secret for the whole process, in the head) is
    # refused, never read as the current one (Note [Host sharing], upstream/mp_host.c).
    producer, consumer = make("host"), make("host")
    ptr = producer.alloc(MiB)
    handle = producer.export(ptr)
    region = handle.region
    head = 6 + region[5] + 4 + 4 + 8 + 8 + 1 + 4
    payload = region[head:]
    pid, k, version = struct.unpack_from("<III", payload)
    assert (k, len(payload)) == (1, 16 + 36)
    fd, secret, inode, nbytes, serial = struct.unpack_from("<IQQQQ", payload, 16)
    former = struct.pack("<IIQ", pid, k, secret) + struct.pack("<IQQQ", fd, inode, nbytes, serial)
    region = region[:head - 4] + struct.pack("<I", len(former)) + former
    data = bytes(handle)[:len(bytes(handle)) - len(handle.region)] + region
    before = state(producer, consumer)
    with pytest.raises(ValueError):
        consumer.import_(mempool.SharedHandle.from_bytes(_with_fields(data,
                                                                      region_len=len(region))))
    assert state(producer, consumer) == before
    consumer.import_(producer.export(ptr)).close()   # the current layout opens
    producer.free(ptr)
