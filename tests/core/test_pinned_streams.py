"""Note [Pinned streams]: the pool keeps every stream object it is given alive while it may
still call the driver with its handle; raw ints are the caller's to keep valid."""
import gc
import weakref

import pytest

S_HANDLE, T_HANDLE = 0x5100, 0x5200


class ProtocolStream:
    """A stream object as cuda.core or any CUDA stream protocol producer hands it over."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class PtrStream:
    """A CuPy-like stream object (``.ptr``)."""

    def __init__(self, handle):
        self.ptr = handle


@pytest.mark.parametrize("make", [ProtocolStream, PtrStream])
def test_a_stream_object_stays_alive_while_the_pool_may_use_it(sim, make):
    pool = sim()
    stream = make(S_HANDLE)
    alive = weakref.ref(stream)
    ptr = pool.alloc(4096, stream=stream)
    pool.free(ptr)
    del stream
    gc.collect()
    # Its cached block still names the handle: the object must outlive it.
    assert alive() is not None
    assert set(pool.pinned_streams) == {S_HANDLE}
    assert pool.pinned_streams[S_HANDLE] is alive()


def test_forget_stream_lets_the_object_go(sim):
    pool = sim()
    stream = ProtocolStream(S_HANDLE)
    alive = weakref.ref(stream)
    pool.free(pool.alloc(4096, stream=stream))
    pool.forget_stream(stream)
    del stream
    gc.collect()
    assert alive() is None
    assert pool.pinned_streams == {}
    # The block moved to the legacy stream and still serves requests there.
    assert pool.alloc(4096, stream=0) is not None


def test_each_distinct_stream_is_pinned_once(sim):
    pool = sim()
    s, t = PtrStream(S_HANDLE), PtrStream(T_HANDLE)
    for _ in range(3):
        for stream in (s, t, s):
            pool.free(pool.alloc(512, stream=stream), stream=stream)
    again = PtrStream(S_HANDLE)   # another wrapper of a handle already pinned: the first stays
    pool.free(pool.alloc(512, stream=again))
    assert pool.pinned_streams == {S_HANDLE: s, T_HANDLE: t}


def test_raw_handles_and_default_streams_are_not_pinned(sim):
    pool = sim()
    pool.free(pool.alloc(512, stream=S_HANDLE))
    for default in (0, 1, 2):
        pool.free(pool.alloc(512, stream=PtrStream(default)))
    assert pool.pinned_streams == {}


def test_a_stream_named_only_at_free_or_record_stream_is_pinned(sim):
    pool = sim()
    a = pool.alloc(4096)
    b = pool.alloc(4096)
    freeing, recorded = PtrStream(S_HANDLE), PtrStream(T_HANDLE)
    pool.record_stream(b, recorded)
    pool.free(a, stream=freeing)
    pool.free(b)
    assert pool.pinned_streams == {S_HANDLE: freeing, T_HANDLE: recorded}


def test_a_bad_stream_object_pins_nothing(sim):
    pool = sim()
    with pytest.raises(TypeError, match="__cuda_stream__"):
        pool.alloc(512, stream=type("Bad", (), {"__cuda_stream__": lambda self: 7})())
    assert pool.pinned_streams == {}
    pool.check_invariants()
    assert pool.used_bytes() == 0


def test_the_stream_named_last_is_not_asked_for_its_handle_again(sim):
    calls = []

    class Counting(ProtocolStream):
        def __cuda_stream__(self):
            calls.append(self.handle)
            return (0, self.handle)

    pool = sim()
    s, t = Counting(S_HANDLE), Counting(T_HANDLE)
    for _ in range(3):
        pool.free(pool.alloc(512, stream=s), stream=s)
    assert calls == [S_HANDLE]
    pool.free(pool.alloc(512, stream=t), stream=t)   # another object: asked once, then known
    pool.free(pool.alloc(512, stream=s), stream=s)
    assert calls == [S_HANDLE, T_HANDLE, S_HANDLE]
    ptr = pool.alloc(512, stream=s)
    assert pool.block_info(ptr)[2] == S_HANDLE
    pool.free(ptr)
