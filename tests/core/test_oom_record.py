"""The OOM record (mp_oom, mp_core.h): the figures of an OutOfMemoryError are one snapshot of
the pool, taken under its lock where the fallback chain gave up, not read one by one after
the lock is dropped while other threads allocate and free."""
import threading

import mempool
from _support import MiB

S1, S2 = 7, 9


def oom(pool, nbytes, stream=None):
    try:
        pool.alloc(nbytes, stream)
    except mempool.OutOfMemoryError as e:
        return e
    raise AssertionError(f"an allocation of {nbytes} bytes was not refused")


def test_record_is_the_pool_at_the_refusal(sim):
    pool = sim(limit=64 * MiB)
    a = pool.alloc(3 * MiB, S1)
    b = pool.alloc(12 * MiB, S1)
    c = pool.alloc(100_000, S2)
    pool.free(a)
    e = oom(pool, 60 * MiB, S1)
    r = e.record
    # Nothing ran since: the record is what the pool's own views say now.
    assert r["nbytes"] == 60 * MiB and r["rounded"] == pool._round_size(60 * MiB)
    assert r["reserved_bytes"] == pool.reserved_bytes()
    assert r["used_bytes"] == pool.used_bytes()
    assert r["cached_bytes"] == pool.cached_bytes()
    assert r["largest_free_block"] == pool.largest_free_block()
    assert r["num_ooms"] == pool.stats()["num_ooms"] == 1
    assert r["reserved_bytes"] == r["used_bytes"] + r["pending_bytes"] + r["cached_bytes"]
    assert 0 < r["largest_free_block"] <= r["cached_bytes"]
    # The message is built from the record.
    assert "rounded to" in str(e) and "largest free block" in str(e)
    pool.free(b)
    pool.free(c)
    assert oom(pool, 1 << 40).record["num_ooms"] == 2


def test_each_refusal_carries_its_own_record():
    # Records are per thread and per refusal: a second pool's refusal in between does not
    # replace the first one's.
    p = mempool.Pool(backend="sim", limit=8 * MiB)
    q = mempool.Pool(backend="sim", limit=64 * MiB)
    x = q.alloc(MiB)
    e1 = oom(p, 10 * MiB)
    e2 = oom(q, 80 * MiB)
    assert e1.record["used_bytes"] == 0 and e1.record["nbytes"] == 10 * MiB
    assert e2.record["used_bytes"] == q.used_bytes() and e2.record["nbytes"] == 80 * MiB
    q.free(x)


def test_record_adds_up_while_other_threads_allocate_and_free(sim):
    pool = sim(limit=256 * MiB)
    stop = threading.Event()
    errors = []

    def churn(stream):
        sizes = [512, 40_000, 3 * MiB, 700_000, 12 * MiB]
        held = []
        try:
            i = 0
            while not stop.is_set():
                try:
                    held.append(pool.alloc(sizes[i % len(sizes)], stream))
                except mempool.OutOfMemoryError:
                    pass
                if len(held) > 6:
                    pool.free(held.pop(0))
                i += 1
            for ptr in held:
                pool.free(ptr)
        except Exception as exc:   # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in (S1, S2, 11)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            r = oom(pool, 300 * MiB, 13).record
            assert r["reserved_bytes"] == r["used_bytes"] + r["pending_bytes"] + r["cached_bytes"], r
            assert r["largest_free_block"] <= r["cached_bytes"], r
            assert r["reserved_bytes"] <= 256 * MiB, r
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
