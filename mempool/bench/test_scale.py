"""Scale: the round trip with many blocks live, and many Python threads at once.

- ``live``: 10^2, 10^4 and 10^6 blocks of seeded log-uniform sizes (512 B-64 KiB) are
  allocated first and held; then 512 B pairs are timed. A pool whose lookups or free lists
  degrade with size shows it here. 10^6 runs on sim, and on cuda where it fits (about
  13 GiB). Under --benchmark-disable the pre-fill is capped (benchkit.LIVE_AS_TEST).
- ``threads``: 1, 2, 4 and 8 Python threads each run the pairs of a round at once on the
  default stream; the figure is wall time per pair over all threads (lower = more
  throughput). Threads are started once and released together by a barrier each round;
  each runs 5 x the usual pairs a round, so the hand-off stays out of the figure.
"""
import threading

import pytest

from .benchkit import GPU_MARKS, live_count, log_uniform_sizes, measure
from .contenders import BY_ID

LIVE_COUNTS = [10**2, 10**4, 10**6]
LIVE_ROWS = ["mempool-sim", "cloop-sim", "mempool-cuda", "cloop-cuda", "torch-caching",
             "cupy-pool"]
THREAD_COUNTS = [1, 2, 4, 8]
THREAD_ROWS = ["mempool-sim", "mempool-host", "mempool-cuda", "torch-caching", "cupy-pool"]
THREAD_ROUND_FACTOR = 5     # pairs per thread per round = 5 x the usual pairs


def _entries(ids):
    return [pytest.param(BY_ID[i], id=i, marks=GPU_MARKS if BY_ID[i].gpu else ())
            for i in ids]


@pytest.mark.parametrize("n_live", LIVE_COUNTS,
                         ids=[f"live1e{len(str(n)) - 1}" for n in LIVE_COUNTS])
@pytest.mark.parametrize("entry", _entries(LIVE_ROWS))
def test_live(benchmark, pairs, entry, n_live):
    n = live_count(benchmark, n_live)
    with entry.open() as contender:
        held = [contender.alloc(nbytes) for nbytes in log_uniform_sizes(n, 512, 64 << 10)]
        try:
            measure(benchmark, contender.fixed_loop(512), pairs, section="scale",
                    row=entry.label, column=f"{n_live:.0e} live".replace("+0", ""),
                    order=n_live, ref=entry.ref, backend=entry.backend, nbytes=512,
                    live_blocks=n)
            benchmark.extra_info.update(contender.info())
        finally:
            if contender.free is not None:
                for handle in held:
                    contender.free(handle)
            held.clear()
        contender.check()


class Gang:
    """`n` threads that each run `work()` once per round, released together."""

    def __init__(self, n, work):
        self.work = work
        self.start = threading.Barrier(n + 1)
        self.done = threading.Barrier(n + 1)
        self.stop = False
        self.errors = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self):
        while True:
            self.start.wait()
            if self.stop:
                return
            try:
                self.work()
            except BaseException as exc:  # reported by round(), not lost in the thread
                self.errors.append(exc)
            self.done.wait()

    def round(self, _=None):
        self.start.wait()
        self.done.wait()
        if self.errors:
            raise self.errors[0]

    def close(self):
        self.stop = True
        self.start.wait()
        for t in self.threads:
            t.join()


@pytest.mark.parametrize("n_threads", THREAD_COUNTS, ids=[f"{t}threads" for t in THREAD_COUNTS])
@pytest.mark.parametrize("entry", _entries(THREAD_ROWS))
def test_threads(benchmark, pairs, entry, n_threads):
    # Longer rounds than elsewhere: waking the threads each round must stay in the noise.
    per_thread = pairs * THREAD_ROUND_FACTOR
    with entry.open() as contender:
        loop = contender.fixed_loop(512)
        gang = Gang(n_threads, lambda: loop(per_thread))
        try:
            measure(benchmark, gang.round, per_thread * n_threads, section="threads",
                    row=entry.label, column=f"{n_threads} thread" + "s" * (n_threads > 1),
                    order=n_threads, ref=entry.ref, backend=entry.backend, nbytes=512,
                    threads=n_threads)
        finally:
            gang.close()
        contender.check()
