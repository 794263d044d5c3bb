"""What each driver call of an expandable segment costs on this GPU, next to cuMemAlloc.

    python3 bench/vmm_costs.py [--out costs.json] [--reps 200]

An expandable pool grows by cuMemCreate + cuMemMap of each page and one cuMemSetAccess per
map call, and shrinks by cuMemUnmap + cuMemRelease of each page (mp_cuda.c, Note [Expandable
pages]); a pool of fixed segments calls cuMemAlloc(FromPoolAsync) and cuMemFree once each.
This times each call alone (median and 90th percentile of `--reps` calls, µs), for one
granularity page, for physical handles of several pages, and for access set over ranges of
several pages, so that the per-event cost of a replay can be split among them
(docs/expandable.md, "Where the time goes"). It talks to libcuda through ctypes and needs
nothing else; the layouts are CUDA 11.2-13's, as in mp_cuda.c.
"""
import argparse
import ctypes
import json
import statistics
import sys
import time


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


PINNED, DEVICE, READWRITE = 1, 1, 3
u64 = ctypes.c_ulonglong


class Driver:
    def __init__(self, device=0):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
        self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.prop = AllocationProp(type=PINNED, location=Location(DEVICE, device))
        self.access = AccessDesc(location=Location(DEVICE, device), flags=READWRITE)
        g = ctypes.c_size_t()
        self.check(self.cu.cuMemGetAllocationGranularity(ctypes.byref(g),
                                                         ctypes.byref(self.prop), 0),
                   "cuMemGetAllocationGranularity")
        self.page = g.value

    @staticmethod
    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    def reserve(self, nbytes):
        va = u64()
        self.check(self.cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(nbytes),
                                               ctypes.c_size_t(self.page), u64(0), u64(0)),
                   "cuMemAddressReserve")
        return va.value

    def create(self, nbytes):
        h = u64()
        self.check(self.cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(nbytes),
                                       ctypes.byref(self.prop), u64(0)), "cuMemCreate")
        return h.value

    def map(self, va, nbytes, handle, offset=0):
        self.check(self.cu.cuMemMap(u64(va), ctypes.c_size_t(nbytes), ctypes.c_size_t(offset),
                                    u64(handle), u64(0)), "cuMemMap")

    def set_access(self, va, nbytes):
        self.check(self.cu.cuMemSetAccess(u64(va), ctypes.c_size_t(nbytes),
                                          ctypes.byref(self.access), ctypes.c_size_t(1)),
                   "cuMemSetAccess")

    def unmap(self, va, nbytes):
        self.check(self.cu.cuMemUnmap(u64(va), ctypes.c_size_t(nbytes)), "cuMemUnmap")

    def release(self, handle):
        self.check(self.cu.cuMemRelease(u64(handle)), "cuMemRelease")

    def alloc(self, nbytes):
        p = u64()
        self.check(self.cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        return p.value

    def free(self, p):
        self.check(self.cu.cuMemFree_v2(u64(p)), "cuMemFree")


def timed(fn):
    t0 = time.perf_counter_ns()
    out = fn()
    return (time.perf_counter_ns() - t0) / 1000.0, out


def summary(samples):
    s = sorted(samples)
    return {"median_us": round(statistics.median(s), 2),
            "p90_us": round(s[int(0.9 * (len(s) - 1))], 2), "n": len(s)}


def page_cycle(d, reps, pages_per_handle, pages_per_access):
    """Map `reps` handles of `pages_per_handle` pages side by side (each handle mapped with
    one cuMemMap, access set in calls covering `pages_per_access` pages), then unmap and
    release them all, timing every call."""
    hbytes = pages_per_handle * d.page
    va = d.reserve(reps * hbytes)
    times = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    handles = []
    try:
        for i in range(reps):
            t, h = timed(lambda: d.create(hbytes))
            times["create"].append(t)
            handles.append(h)
            t, _ = timed(lambda: d.map(va + i * hbytes, hbytes, h))
            times["map"].append(t)
        span = pages_per_access * d.page
        for off in range(0, reps * hbytes, span):
            n = min(span, reps * hbytes - off)
            t, _ = timed(lambda: d.set_access(va + off, n))
            times["set_access"].append(t)
        for i, h in enumerate(handles):
            t, _ = timed(lambda: d.unmap(va + i * hbytes, hbytes))
            times["unmap"].append(t)
            t, _ = timed(lambda: d.release(h))
            times["release"].append(t)
    finally:
        d.check(d.cu.cuMemAddressFree(u64(va), ctypes.c_size_t(reps * hbytes)),
                "cuMemAddressFree")
    return {k: summary(v) for k, v in times.items() if v}


def alloc_cycle(d, reps, nbytes):
    ta, tf = [], []
    for _ in range(reps):
        t, p = timed(lambda: d.alloc(nbytes))
        ta.append(t)
        t, _ = timed(lambda: d.free(p))
        tf.append(t)
    return {"cuMemAlloc": summary(ta), "cuMemFree": summary(tf)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200, help="calls timed per row (default 200)")
    ap.add_argument("--out", help="write the table as JSON here")
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error("--reps must be at least 2")
    try:
        d = Driver()
    except (OSError, RuntimeError) as exc:
        print(f"no CUDA driver or device: {exc}")
        return 0
    mib = d.page / 2**20
    rows = {}
    page_cycle(d, 20, 1, 1)  # warm the driver's paths before timing
    # A handle is mapped whole: mapping part of one (cuMemMap with an offset) failed with
    # CUDA_ERROR_NOT_SUPPORTED on the H200's driver, so a page cannot be cut from a chunk.
    for per_handle, per_access in ((1, 1), (1, 16), (4, 4), (16, 16)):
        key = f"{per_handle * mib:g} MiB handles, access per {per_access * mib:g} MiB"
        rows[key] = page_cycle(d, args.reps, per_handle, per_access)
    for nbytes in (d.page, 10 * d.page, 32 * d.page):
        rows[f"cuMemAlloc {nbytes / 2**20:g} MiB"] = alloc_cycle(d, args.reps, nbytes)
    print(f"page (granularity): {mib:g} MiB; µs per call, median (p90) of {args.reps}")
    for key, calls in rows.items():
        cells = ", ".join(f"{k} {v['median_us']:.1f} ({v['p90_us']:.1f})"
                          for k, v in calls.items())
        print(f"{key}: {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"page_bytes": d.page, "reps": args.reps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
