"""PyTorch's CUDA allocator against mempool's, allocate + free timed from C++.

    python bench/torch_allocator_pairs.py [--procs 6] [--rounds 9] [--pairs 20000]
                                          [--cpu N] [--json FILE]

`torch.empty` + drop (bench/torch_workloads.py --workloads empty) times the whole call, of
which the allocator is a part: argument parsing, the dispatcher and the tensor cost the same
under either allocator. This times only the allocator: `CUDACachingAllocator::get()->allocate`
and the DataPtr's deleter in a C++ loop (bench/torch_allocator_pairs.cpp, compiled here
against the installed PyTorch's headers). Each allocator runs in processes of its own
(PyTorch picks its allocator once per process), alternating, all pinned to one CPU; each
process prints the median of its rounds per size, and the summary gives the median and the
worst process of each allocator, and mempool's over PyTorch's process by process.
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = (512, 65536, 1048576, 67108864)
ALLOCATORS = ("caching", "mempool")
# piece_ns's pieces (torch_allocator_pairs.cpp), by number: calls both allocators make in
# each allocate or free, and (mempool only) the pool's own C entry points as a pair.
PIECES = ("cudaGetDevice", "c10::cuda::current_device", "getCurrentCUDAStream",
          "memoryProfilingEnabled", "GPUTrace::get_trace", "the pool's C entry points, a pair")


def build(out_dir):
    """The probe's shared library, compiled for the PyTorch imported here; its path."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from mempool import torch_build as tb

    cxx = tb._compiler()
    torch_includes, torch_lib = tb._torch_paths(torch)
    cuda_includes = tb._cuda_include_dirs(torch)
    std = tb.cxx_standard(tb.torch_version(torch.__version__))
    lib = Path(out_dir) / "torch_allocator_pairs.so"
    cmd = [cxx, f"-std={std}", "-O2", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{d}" for d in torch_includes), *(f"-I{d}" for d in cuda_includes),
           str(HERE / "torch_allocator_pairs.cpp"), f"-L{torch_lib}", "-lc10", "-lc10_cuda",
           f"-Wl,-rpath,{torch_lib}", "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compiling the probe failed:\n{done.stderr[-4000:]}")
    return lib


def child(allocator, lib, rounds, pairs):
    import torch

    if allocator == "mempool":
        import mempool
        import mempool.torch

        mempool.torch.install(mempool.Pool(backend="cuda", device=0))
    elif allocator != "caching":
        raise SystemExit(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    torch.empty(1, device="cuda")          # CUDA and the allocator set up
    probe = ctypes.CDLL(str(lib))
    probe.allocator_pairs_ns.restype = ctypes.c_double
    probe.allocator_pairs_ns.argtypes = [ctypes.c_size_t, ctypes.c_long]
    out = {}
    for size in SIZES:
        per_round = [probe.allocator_pairs_ns(size, pairs) for _ in range(rounds)]
        out[str(size)] = {"ns_per_pair": statistics.median(per_round), "rounds": per_round}
    probe.piece_ns.restype = ctypes.c_double
    probe.piece_ns.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_size_t, ctypes.c_void_p,
                               ctypes.c_void_p]
    entry = (None, None)
    if allocator == "mempool":
        glue = ctypes.CDLL(mempool.torch.library_path())
        entry = tuple(ctypes.cast(f, ctypes.c_void_p).value
                      for f in (glue.mempool_torch_alloc, glue.mempool_torch_free))
    pieces = {}
    for i, name in enumerate(PIECES):
        ns = statistics.median(probe.piece_ns(i, pairs, 512, *entry) for _ in range(rounds))
        if ns >= 0:
            pieces[name] = ns
    out["pieces"] = pieces
    print(json.dumps(out), flush=True)
    return 0


def summarize(procs):
    lines = []
    for size in map(str, SIZES):
        got = {a: [p[size]["ns_per_pair"] for p in procs[a]] for a in ALLOCATORS}
        ratios = [m / c for c, m in zip(got["caching"], got["mempool"])]
        lines.append(
            f"{size} B: PyTorch median {statistics.median(got['caching']):.1f} ns "
            f"(worst {max(got['caching']):.1f}), mempool median "
            f"{statistics.median(got['mempool']):.1f} ns (worst {max(got['mempool']):.1f}); "
            f"mempool / PyTorch process by process " + ", ".join(f"{r:.2f}" for r in ratios)
            + f" (worst {max(ratios):.2f})")
    for name in PIECES:
        got = {a: [p["pieces"][name] for p in procs[a] if name in p.get("pieces", {})]
               for a in ALLOCATORS}
        lines.append(f"{name}: " + "; ".join(
            f"{a} median {statistics.median(v):.1f} ns (worst {max(v):.1f})"
            for a, v in got.items() if v))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=6, help="processes per allocator")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--cpu", type=int, default=None,
                    help="the CPU every child is pinned to (default: the one whose pace is "
                         "the fastest as the run starts, as torch_workloads.py picks)")
    ap.add_argument("--json", help="write every process's figures here")
    ap.add_argument("--child", nargs=2, metavar=("ALLOCATOR", "LIB"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1], args.rounds, args.pairs)

    if args.cpu is None:
        import torch_workloads   # this folder's; stdlib only at import

        (cpu,), _ = torch_workloads.fastest_cpus(1)
    else:
        cpu = args.cpu
    procs = {a: [] for a in ALLOCATORS}
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp)
        for i in range(args.procs):
            # A B, B A, ...: neither allocator always runs first on a CPU just warmed.
            for a in (ALLOCATORS if i % 2 == 0 else ALLOCATORS[::-1]):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", a, str(lib), "--rounds",
                     str(args.rounds), "--pairs", str(args.pairs)],
                    capture_output=True, text=True,
                    preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
                if done.returncode:
                    raise SystemExit(f"the {a} child failed:\n{done.stderr[-4000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                procs[a].append(result)
                sizes = {s: round(r["ns_per_pair"], 1) for s, r in result.items() if s != "pieces"}
                print(a, sizes, {k: round(v, 1) for k, v in result["pieces"].items()}, flush=True)
    print(summarize(procs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "rounds": args.rounds, "pairs": args.pairs, **procs}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
