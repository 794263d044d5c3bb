"""Sharing blocks between pools, in one process (docs/sharing.md, "Other processes"; Note
[Sharing across processes] in core/mp_share.c): export, import_, the pin an export puts on a
block until its consumers let go, collect_shared, the retry before an OutOfMemoryError, the
handle's wire form, and refusals. The same protocol across processes is in
test_share_processes.py; hostile handle bytes in test_share_hostile.py."""
import pickle

import numpy
import pytest

import mempool

MiB = 1 << 20


def make(backend, **options):
    options.setdefault("capacity", "256MiB")
    if backend == "host":
        options.setdefault("ipc", True)
    return mempool.Pool(backend, **options)


@pytest.fixture(params=["sim", "host"])
def backend(request):
    return request.param


def test_ipc_defaults_by_backend():
    assert mempool.Pool("sim", capacity="64MiB").options["ipc"] is True
    assert mempool.Pool("host", capacity="64MiB").options["ipc"] is False
    assert mempool.Pool("host", capacity="64MiB", ipc=True).options["ipc"] is True
    assert mempool.Pool.from_conf("backend:sim,ipc:false,capacity:64MiB").options["ipc"] is False


def test_ipc_off_refuses_export_and_says_how():
    pool = mempool.Pool("host", capacity="64MiB")
    ptr = pool.alloc(4096)
    with pytest.raises(RuntimeError, match="ipc=True"):
        pool.export(ptr)
    pool.free(ptr)
    assert pool.used_bytes() == 0


def test_bad_ipc_value_names_the_option():
    with pytest.raises(ValueError, match="ipc"):
        mempool.Pool("sim", ipc="sometimes")


def test_host_round_trip_sees_and_writes_the_same_bytes():
    producer, consumer = make("host"), make("host")
    buf = producer.empty(3 * 4096, "uint8")
    numpy.asarray(buf)[:] = 0x5A
    handle = producer.export(buf)
    assert handle.backend == "host" and handle.nbytes == 3 * 4096
    imported = consumer.import_(handle)
    view = numpy.asarray(imported)
    assert imported.ptr != buf.ptr            # a mapping of its own
    assert (view == 0x5A).all()
    view[:] = 0xA5
    assert (numpy.asarray(buf) == 0xA5).all()
    del view
    imported.close()


def test_sim_round_trip_opens_one_mapping_per_region():
    producer, consumer = make("sim"), make("sim")
    a, b = producer.alloc(4096), producer.alloc(4096)
    ha, hb = producer.export(a), producer.export(b)
    assert ha.region == hb.region              # one segment: one region
    assert ha.offset != hb.offset
    ia, ib = consumer.import_(ha), consumer.import_(hb)
    counters = consumer.device.counters()
    assert counters["open_imports"] == 1 and counters["imports_opened"] == 1
    assert ib.ptr - ia.ptr == hb.offset - ha.offset
    assert consumer.stats()["reserved_bytes.all.current"] == 0   # the memory is not its own
    ia.close()
    assert consumer.device.counters()["open_imports"] == 1
    ib.close()
    assert consumer.device.counters()["open_imports"] == 0


def test_exported_block_is_not_reused_until_released(backend):
    producer, consumer = make(backend), make(backend)
    ptr = producer.alloc(MiB)
    handle = producer.export(ptr)
    imported = consumer.import_(handle)
    producer.free(ptr)                        # pinned: still live
    assert producer.block_info(ptr)[0] >= MiB
    again = producer.alloc(MiB)
    assert again != ptr
    assert producer.collect_shared() == 0
    imported.close()
    assert producer.collect_shared() == 1
    with pytest.raises(ValueError):
        producer.block_info(ptr)
    producer.free(again)
    assert producer.used_bytes() == 0
    producer.check_invariants()


def test_exported_buffer_is_pinned_after_the_producer_drops_it(backend):
    producer, consumer = make(backend), make(backend)
    buf = producer.empty(MiB, "uint8")
    base = buf.ptr
    imported = consumer.import_(producer.export(buf))
    del buf
    assert producer.used_bytes() >= MiB
    assert producer.collect_shared() == 0
    del imported                              # the last holder of the import
    assert producer.collect_shared() == 1
    assert producer.used_bytes() == 0
    with pytest.raises(ValueError):
        producer.block_info(base)


def test_a_handle_in_flight_pins_its_block_until_claimed():
    producer, consumer = make("sim"), make("sim")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    producer.free(ptr)
    assert producer.collect_shared() == 0     # nobody imported it yet
    consumer.import_(handle).close()
    assert producer.collect_shared() == 1
    assert producer.used_bytes() == 0


def test_the_same_handle_imported_twice_counts_both():
    producer, consumer = make("sim"), make("sim")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    first, second = consumer.import_(handle), consumer.import_(handle)
    assert first.ptr == second.ptr
    producer.free(ptr)
    first.close()
    assert producer.collect_shared() == 0
    second.close()
    assert producer.collect_shared() == 1


def test_a_stale_handle_is_refused_and_changes_nothing():
    producer, consumer = make("sim"), make("sim")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    consumer.import_(handle).close()
    producer.free(ptr)
    assert producer.collect_shared() == 1
    before = consumer.device.counters()["imports_opened"]
    with pytest.raises(ValueError, match="stale"):
        consumer.import_(handle)
    assert consumer.device.counters()["imports_opened"] == before
    assert consumer.device.counters()["open_imports"] == 0


def test_views_and_dlpack_exports_keep_the_import_open():
    producer, consumer = make("host"), make("host")
    buf = producer.empty(8192, "uint8")
    numpy.asarray(buf)[:] = 3
    imported = consumer.import_(producer.export(buf))
    view = imported.view((4096,), offset=4096)
    array = numpy.from_dlpack(imported)
    imported.close()
    with pytest.raises(ValueError, match="closed"):
        imported.nbytes
    assert consumer.collect_shared() == 0
    assert (numpy.asarray(view) == 3).all() and (array == 3).all()
    del buf
    assert producer.collect_shared() == 0     # the view and the array still hold it
    del view, array
    assert producer.collect_shared() == 1


def test_collect_before_out_of_memory_retries_once(backend):
    producer = make(backend, capacity="64MiB")
    consumer = make(backend, capacity="64MiB")
    ptr = producer.alloc(40 * MiB)
    imported = consumer.import_(producer.export(ptr))
    producer.free(ptr)
    imported.close()                          # released, not collected yet
    again = producer.alloc(40 * MiB)          # needs the pinned block's memory
    producer.free(again)
    buf = producer.empty(40 * MiB, "uint8")
    assert buf.nbytes == 40 * MiB


def test_expandable_pools_share_the_run_of_pages(backend):
    producer = make(backend, expandable_segments=True, granularity="2MiB")
    consumer = make(backend, expandable_segments=True, granularity="2MiB")
    buf = producer.empty(3 * MiB, "uint8")
    if backend == "host":
        numpy.asarray(buf)[:] = 7
    handle = producer.export(buf)
    imported = consumer.import_(handle)
    assert imported.nbytes == 3 * MiB
    if backend == "host":
        assert (numpy.asarray(imported) == 7).all()
        numpy.asarray(imported)[:1] = 8
        assert numpy.asarray(buf)[0] == 8
    imported.close()
    del buf
    assert producer.collect_shared() == 1
    assert producer.used_bytes() == 0
    producer.check_invariants()


def test_handle_pickles_and_round_trips_through_bytes():
    producer = make("sim")
    handle = producer.export(producer.alloc(4096))
    assert pickle.loads(pickle.dumps(handle)) == handle
    again = mempool.SharedHandle.from_bytes(bytes(handle))
    assert again == handle and hash(again) == hash(handle)
    assert (again.offset, again.nbytes, again.slot) == (handle.offset, handle.nbytes, handle.slot)
    with pytest.raises(AttributeError):
        handle.offset = 0
    with pytest.raises(TypeError):
        mempool.SharedHandle()


def test_bad_argument_types_name_the_argument():
    pool = make("sim")
    with pytest.raises(TypeError, match="handle"):
        pool.import_(b"MPSX")
    with pytest.raises(TypeError, match="buffer_or_ptr"):
        pool.export("0x1000")
    with pytest.raises(TypeError, match="data"):
        mempool.SharedHandle.from_bytes("text")
    with pytest.raises(ValueError):
        pool.export(12345)                    # no block there


def test_import_on_another_backend_names_both():
    producer = make("sim")
    handle = producer.export(producer.alloc(4096))
    with pytest.raises(ValueError, match="'sim'.*'host'"):
        make("host").import_(handle)


def test_closed_pools():
    producer, consumer = make("sim"), make("sim")
    ptr = producer.alloc(4096)
    handle = producer.export(ptr)
    consumer.close()
    for call in (lambda: consumer.import_(handle), lambda: consumer.export(ptr),
                 consumer.collect_shared):
        with pytest.raises(mempool.PoolClosedError):
            call()
    producer.close(force=True)
    with pytest.raises(ValueError, match="ledger"):
        make("sim").import_(handle)           # its ledger went with the producer


def test_an_import_outlives_its_producer_pool():
    producer, consumer = make("host"), make("host")
    buf = producer.empty(4096, "uint8")
    numpy.asarray(buf)[:] = 9
    imported = consumer.import_(producer.export(buf))
    del buf
    producer.close(force=True)
    assert (numpy.asarray(imported) == 9).all()   # the mapping keeps the memory
    imported.close()


def test_a_pinned_free_on_another_stream_is_made_on_that_stream():
    producer, consumer = make("sim"), make("sim")
    ptr = producer.alloc(MiB, stream=0)
    imported = consumer.import_(producer.export(ptr))
    producer.free(ptr, stream=7)              # last used on stream 7: its free comes later
    imported.close()
    assert producer.collect_shared() == 1
    block = next(b for seg in producer.layout() for b in seg["blocks"] if b["address"] == ptr)
    assert block["stream"] == 7                   # the block now serves stream 7


def test_close_gives_back_released_exports_first():
    producer, consumer = make("sim"), make("sim")
    ptr = producer.alloc(4096)
    consumer.import_(producer.export(ptr)).close()
    producer.free(ptr)                        # pinned until collected
    producer.close()                          # collects first: no live block is left
    assert producer.closed


def test_export_waits_for_the_blocks_stream():
    producer = make("sim")
    ptr = producer.alloc(4096, stream=7)
    producer.device.launch(7)                 # a write queued on the block's stream
    syncs = producer.stats()["num_stream_syncs"]
    producer.export(ptr)
    info = producer.device.stream_info(7)
    assert info["completed"] == info["submitted"]
    assert producer.stats()["num_stream_syncs"] == syncs + 1


def test_a_block_freed_while_pinned_cannot_be_exported_or_freed_again():
    producer, consumer = make("sim"), make("sim")
    ptr = producer.alloc(4096)
    imported = consumer.import_(producer.export(ptr))
    producer.free(ptr)
    with pytest.raises(ValueError):
        producer.export(ptr)
    with pytest.raises(ValueError):
        producer.free(ptr)
    imported.close()
    assert producer.collect_shared() == 1
