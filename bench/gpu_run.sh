#!/usr/bin/env bash
# The GPU run: build, test every tier's gpu-marked tests, test them again under
# compute-sanitizer's memcheck, run the benchmarks, and write OUTDIR/summary.txt and the
# run's figures as OUTDIR/<card>.json (bench/collect_results.py; the schema is at the top of
# bench/render_benchmarks.py): a file that can replace bench/results/<card>.json, from which
# BENCHMARKS.md is rendered.
#
#   bench/gpu_run.sh OUTDIR
#
# For a machine with a CUDA device and no network: nothing is downloaded. Every stage runs
# whatever the one before it did (a failing build is reported, and the tests then show what
# works); each has a time limit (below).
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PY OUT  # the fragmentation stage runs in a child shell
export PYTHONUNBUFFERED=1

# Stage time limits in seconds, and which stages run (e.g. STAGES="build tests bench" when
# there is no time for memcheck). T_SANITIZER holds for each memcheck process (one per test
# file by default: on an H200 each took under 60 s but the PyTorch drop-in's, 176 s); the
# memcheck stage alone takes about 9 minutes, so a 10-minute call runs it on its own.
T_BUILD=${T_BUILD:-100}
T_TESTS=${T_TESTS:-540}   # for each pytest process (tests/gpu: over 420 s in one process, 123-142 s in four workers on an H100)
T_SANITIZER=${T_SANITIZER:-200}   # for each group of SANITIZER_GROUPS (the PyTorch drop-in: 176 s)
T_BENCH=${T_BENCH:-240}
T_FRAG=${T_FRAG:-120}
T_TORCH=${T_TORCH:-480}
T_CHURN=${T_CHURN:-120}
T_VMM=${T_VMM:-60}
T_SNAPSHOT=${T_SNAPSHOT:-240}   # six processes of 14-28 s each, and start-up
T_OWNTESTS=${T_OWNTESTS:-540}   # every pair of PyTorch's own tests, each under both allocators
T_ALLOCPAIRS=${T_ALLOCPAIRS:-150}   # twelve processes of 6-8 s each, and the probe's build
T_COLDPAIRS=${T_COLDPAIRS:-90}   # eight processes of a few seconds each, and the build
T_NUMBAOWN=${T_NUMBAOWN:-240}   # both runs of numba-cuda's cudadrv tests (13-15 s each on an H100)
T_CORPUS=${T_CORPUS:-560}   # 5 columns x 11 traces x CORPUS_PROCESSES processes in CORPUS_LANES lanes, most of it start-up
STAGES=" ${STAGES:-build tests sanitizer bench churn vmm fragmentation torch allocpairs coldpairs snapshot owntests numbaown} "
# SANITIZER_GROUPS: a file with one line of pytest arguments per memcheck process (default:
# one process per file of tests/gpu, and one for the upstream contract's cuda cases; not
# the three files of examples and scripts run in child processes; in one process for all of
# them a test hung under the sanitizer after others had run). A group
# that hangs or runs over its limit then costs only its own results; pytest prints every
# thread's stack of a test still running after 3/4 of the limit, so a hang shows where.
SANITIZER_GROUPS=${SANITIZER_GROUPS:-}
wants() { [[ $STAGES == *" $1 "* ]]; }

declare -A STATUS
stage() {  # stage NAME LOG CMD...: run CMD with its output tee'd to LOG, record its status
    local name=$1 log=$2
    shift 2
    if ! wants "$name"; then
        STATUS[$name]="not selected"
        return
    fi
    echo "=== $name: $*" | tee "$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=$?
    STATUS[$name]=$rc
    echo "=== $name: exit status $rc" | tee -a "$log"
}

# ---- versions
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # MEMPOOL_COMMIT names the commit when the tree was copied without its git history, or
    # with a stale one (a copy of the working tree whose .git said an older commit: set it).
    echo "commit: ${MEMPOOL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "nvidia-smi: not available"
    "$PY" -V 2>&1
    for mod in cupy torch jax numpy Cython pytest; do
        "$PY" -c "import $mod; print('$mod', $mod.__version__)" 2>/dev/null || echo "$mod: not installed"
    done
    "$PY" -c "import cupy; print('cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'driver', cupy.cuda.runtime.driverGetVersion())" 2>&1 || true
    command -v compute-sanitizer >/dev/null && compute-sanitizer --version 2>&1 | tail -1
} 2>&1 | tee "$OUT/versions.txt"

# ---- wheels carried in .whl/ (dask, distributed and their needs, for tests/gpu/test_gpu_dask.py
# and the Dask examples; the machine has no package index): installed beside the environment.
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/mempool-site .whl/*.whl \
        && export PYTHONPATH=/tmp/mempool-site${PYTHONPATH:+:$PYTHONPATH} \
        || echo "the wheels in .whl/ did not install; tests needing them will skip"
fi

# ---- build (editable install; the in-place build when pip cannot)
build() {
    timeout "$T_BUILD" "$PY" -m pip install --no-build-isolation --no-deps -e . && return 0
    echo "pip install -e failed; building in place"
    timeout "$T_BUILD" "$PY" setup.py build_ext --inplace
}
stage build "$OUT/build.log" build

# ---- options every pytest run shares. A crash (a segfault in a test) must not end the run:
# with pytest-xdist a crashed worker is replaced and only its test is lost.
# A test stuck in a driver call is cut by pytest-timeout (60 s; memcheck makes everything
# slower, but the whole tier takes about 150 s under it).
# -rP keeps what passing tests print (the side-by-side tables of the examples).
PYTEST_OPTS=(-p no:cacheprovider -raP -v --durations 20)
export MEMPOOL_TEST_EXIT_WATCHDOG=30   # tests/conftest.py: stacks of a hang at exit
if "$PY" -c "import xdist" 2>/dev/null; then
    PYTEST_OPTS+=(-n 1)
fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST_OPTS+=(--timeout 60)
fi

# ---- the GPU tests of every tier
# TESTS_ARGS narrows it to some files or tests (default: every gpu-marked test of tests/, in
# pytest processes of their own, tests/gpu then the gpu-marked tests of tests/core, upstreams, integrations, tools and project, each
# with T_TESTS: a process cut at its limit loses the failure reports it prints at its end).
gpu_tests() {
    local rc=0
    if [ -n "${TESTS_ARGS:-}" ]; then
        timeout "$T_TESTS" "$PY" -m pytest -m gpu $TESTS_ARGS "${PYTEST_OPTS[@]}" \
            --junitxml "$OUT/junit-gpu.xml" || rc=$?
        return $rc
    fi
    # tests/gpu in GPU_TEST_WORKERS pytest-xdist workers: most of its time is child
    # processes importing PyTorch, which the device's CPUs run side by side. Tests marked
    # gpu_exclusive read or fill the whole device's memory, so they run after, alone.
    if [[ " ${PYTEST_OPTS[*]} " == *" -n "* ]] && [ "${GPU_TEST_WORKERS:-4}" -gt 1 ]; then
        timeout "$T_TESTS" "$PY" -m pytest -m "gpu and not gpu_exclusive" tests/gpu \
            "${PYTEST_OPTS[@]}" -n "${GPU_TEST_WORKERS:-4}" \
            --junitxml "$OUT/junit-gpu-1.xml" || rc=$?
        timeout "$T_TESTS" "$PY" -m pytest -m "gpu and gpu_exclusive" tests/gpu \
            "${PYTEST_OPTS[@]}" --junitxml "$OUT/junit-gpu-1x.xml" || rc=$?
    else
        timeout "$T_TESTS" "$PY" -m pytest -m gpu tests/gpu "${PYTEST_OPTS[@]}" \
            --junitxml "$OUT/junit-gpu-1.xml" || rc=$?
    fi
    timeout "$T_TESTS" "$PY" -m pytest -m gpu tests/core tests/upstreams tests/integrations tests/tools tests/project "${PYTEST_OPTS[@]}" \
        --junitxml "$OUT/junit-gpu-2.xml" || rc=$?
    return $rc
}
stage tests "$OUT/tests.log" gpu_tests

# ---- the GPU tier under memcheck: out-of-bounds and misaligned device accesses, and bad
# frees, anywhere in kernels that touch pool memory. Failing API calls are not reported:
# the tests make them on purpose (out of memory, invalid handles). Host backtraces are off:
# taking one, the sanitizer takes the GIL inside the driver's launch and keeps a Python frame
# of the launch alive, which pins the arrays of that frame's callers; device backtraces stay.
if ! wants sanitizer; then
    STATUS[sanitizer]="not selected"
elif command -v compute-sanitizer >/dev/null; then
    memcheck_groups() {
        local i=0 rc=0 group_rc args sanitizer_timeout=
        # A test under memcheck may take longer than pytest-timeout's 60 s without hanging
        # (torch.compile's kernel compilation in a child took over a minute on the H200):
        # each test may then use its group's limit, less the time to report.
        if [[ " ${PYTEST_OPTS[*]} " == *" --timeout "* ]] && [ "$T_SANITIZER" -gt 75 ]; then
            sanitizer_timeout="--timeout $((T_SANITIZER - 15))"
        fi
        while read -r -a args; do
            [ ${#args[@]} -eq 0 ] && continue
            i=$((i + 1))
            echo "--- memcheck group $i: ${args[*]}"
            timeout "$T_SANITIZER" compute-sanitizer --tool memcheck \
                --target-processes all --report-api-errors no --error-exitcode 99 \
                --show-backtrace device \
                --print-limit 200 --log-file "$OUT/sanitizer-report.$i.%p.txt" \
                "$PY" -m pytest -m gpu "${args[@]}" "${PYTEST_OPTS[@]}" \
                -o faulthandler_timeout=$((T_SANITIZER * 3 / 4)) $sanitizer_timeout \
                --junitxml "$OUT/junit-sanitizer-$i.xml" &
            local pid=$! waited=0
            # A group still running near its limit: take every thread's native stack of
            # its Python processes (which driver call, which lock), then let it run out.
            while kill -0 "$pid" 2>/dev/null && [ $waited -lt $((T_SANITIZER - 10)) ]; do
                sleep 1; waited=$((waited + 1))
            done
            if kill -0 "$pid" 2>/dev/null; then
                bash bench/hang_stacks.sh "$pid" >"$OUT/sanitizer-hang.$i.txt" 2>&1
            fi
            group_rc=0
            wait "$pid" || group_rc=$?
            [ $group_rc -ne 0 ] && rc=$group_rc
            echo "--- memcheck group $i: exit status $group_rc"
        done < <(if [ -n "$SANITIZER_GROUPS" ]; then cat "$SANITIZER_GROUPS"
                 else printf '%s\n' tests/gpu/test_*.py tests/upstreams/test_contract.py |
                      grep -v -e test_gpu_demo.py -e test_gpu_examples.py \
                              -e test_gpu_torch_allocator.py; fi)
        return $rc
    }
    stage sanitizer "$OUT/sanitizer.log" memcheck_groups
else
    echo "compute-sanitizer not found: memcheck stage skipped" | tee "$OUT/sanitizer.log"
    STATUS[sanitizer]=skipped
fi

# ---- benchmarks (they report; nothing gates on them)
# `python -m mempool bench` writes bench.json, bench.log, table.txt and latency.png under
# OUTDIR/bench; BENCH_ARGS narrows it (e.g. BENCH_ARGS="-k latency") when time is short.
stage bench "$OUT/bench-stage.log" timeout "$T_BENCH" "$PY" -m mempool bench --out "$OUT/bench" \
    ${BENCH_ARGS:-}

# ---- stream churn on the device: 100,000 streams made, used and forgotten; host RSS and
# reserved address space must stay flat (mempool/bench/test_stream_churn.py).
stage churn "$OUT/churn.log" timeout "$T_CHURN" "$PY" -m pytest mempool/bench/test_stream_churn.py \
    --benchmark-enable -k cuda -p no:cacheprovider -rs -s

# ---- what each driver call of an expandable segment costs (bench/vmm_costs.py)
stage vmm "$OUT/vmm.log" timeout "$T_VMM" "$PY" bench/vmm_costs.py --out "$OUT/vmm_costs.json"

# ---- fragmentation: the shipped traces through mempool, PyTorch and CuPy on the device,
# then the largest batch that fits under a fixed limit with and without expandable segments;
# FRAG_ARGS narrows or widens the first (e.g. "--repeat 2 --pages 8MiB").
frag() {
    "$PY" bench/fragmentation_gpu.py --out "$OUT/fragmentation_gpu.json" ${FRAG_ARGS:-} || return
    "$PY" bench/largest_batch.py --backend cuda --out "$OUT/largest_batch.json"
}
stage fragmentation "$OUT/fragmentation.log" timeout "$T_FRAG" bash -c "$(declare -f frag); frag"

# ---- PyTorch workloads (bench/torch_workloads.py): GPT and ResNet-50 training, compiled
# inference, the largest batch under a cap and torch.empty, under PyTorch's allocator and
# mempool's, each in processes of their own; TORCH_ARGS narrows it (e.g. "--workloads gpt").
stage torch "$OUT/torch-workloads.log" timeout "$T_TORCH" "$PY" bench/torch_workloads.py \
    "$OUT/torch" ${TORCH_ARGS:-}

# ---- the trace corpus on the device (mempool/traces/corpus, its tuning and held-out halves):
# peak reserved over peak live and ns per event of the pool's two modes, PyTorch's two and the
# driver's own cudaMemPool, each cell replayed in CORPUS_PROCESSES processes of its own
# (pinned, interleaved; the time is their median, the worst stated), the traces in
# CORPUS_LANES lanes side by side on CPUs of their own (bench/corpus_lanes.py: one after
# another, six processes a cell outlast a call; docs/decisions.md).
# Not in the default stages: it runs alone (STAGES="build corpus").
stage corpus "$OUT/corpus.log" timeout "$T_CORPUS" "$PY" bench/corpus_lanes.py \
    "$OUT/corpus.json" --lanes "${CORPUS_LANES:-4}" --processes "${CORPUS_PROCESSES:-6}" \
    --timeout $((T_CORPUS - 20))

# ---- the allocators alone: PyTorch's and mempool's allocate + free timed from C++, and the
# calls any allocator behind PyTorch's interface makes (bench/torch_allocator_pairs.py): the
# part of torch.empty's time an allocator can change.
stage allocpairs "$OUT/allocator-pairs.log" timeout "$T_ALLOCPAIRS" "$PY" \
    bench/torch_allocator_pairs.py --json "$OUT/allocator_pairs.json"

# ---- the core's allocate + free after the caches were emptied, on this host's CPU
# (bench/cold_lines.py: the lines it touches where valgrind is installed, and its time).
stage coldpairs "$OUT/cold-pairs.log" timeout "$T_COLDPAIRS" "$PY" bench/cold_lines.py \
    --sizes 512,67108864 --procs 4 --json "$OUT/cold_pairs.json"

# ---- snapshots: each allocator's allocations and frees in PyTorch's snapshot format, a few
# steps of each workload, so that what the device holds can be worked out on a machine with
# no GPU (`python -m mempool replay FILE`; `bench/driver_model.py --predict --trace FILE`, the
# cudaMemPool under the default path). Their times are not comparable (history is on).
# SNAPSHOT_WORKLOADS and SNAPSHOT_ALLOCATORS narrow or change them.
stage snapshot "$OUT/snapshot.log" timeout "$T_SNAPSHOT" "$PY" bench/torch_workloads.py \
    "$OUT/snapshots" --workloads "${SNAPSHOT_WORKLOADS:-gpt,resnet}" --reps 1 --steps 5 \
    --allocators "${SNAPSHOT_ALLOCATORS:-torch-expandable,mempool,mempool-expandable}" --snapshot
# Whether each mempool run replays on sim to the device's peak (bench/replay_check.py): if
# not, studies of it on sim do not carry over. Appended to the stage's log.
if wants snapshot && [[ -f "$OUT/snapshots/workloads.json" ]]; then
    timeout 300 "$PY" bench/replay_check.py "$OUT/snapshots/workloads.json" \
        >> "$OUT/snapshot.log" 2>&1 || echo "replay check: exit $?" >> "$OUT/snapshot.log"
fi

# ---- PyTorch's own tests (test/test_cuda.py and test/test_multiprocessing.py of PyTorch's
# repository, which its wheels do not ship: put them in OWNTESTS_TESTS), several (file, -k
# selection) pairs (PAIRS of bench/torch_own_tests_pairs.py: the allocator, graph, MemPool and
# IPC tests of test_cuda.py, the CUDA tests of test_multiprocessing.py), each under PyTorch's
# allocator and under `python -m mempool run`, one own-tests.json per pair under
# OUT/own-tests/NAME, all within T_OWNTESTS. OWNTESTS_ONLY names some pairs
# (comma-separated); OWNTESTS_BASELINES, an earlier run's OUT/own-tests folder (same
# machine), whose runs under PyTorch's allocator stand for this run's: they do not depend on
# mempool's code. PyTorch's test helpers need `expecttest`, which the machine may lack: a
# copy in OWNTESTS_SITE (default .external/site) goes on the path.
OWNTESTS_TESTS=${OWNTESTS_TESTS:-.external/pytorch}
OWNTESTS_SITE=${OWNTESTS_SITE:-.external/site}
if wants owntests && ! compgen -G "$OWNTESTS_TESTS/test_*.py" >/dev/null; then
    echo "no test files in $OWNTESTS_TESTS: PyTorch's own tests skipped" | tee "$OUT/own-tests.log"
    STATUS[owntests]=skipped
else
    stage owntests "$OUT/own-tests.log" timeout "$T_OWNTESTS" \
        env PYTHONPATH="$OWNTESTS_SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" \
        bench/torch_own_tests_pairs.py "$OUT/own-tests" --tests "$OWNTESTS_TESTS" \
        --budget $((T_OWNTESTS - 20)) ${OWNTESTS_ONLY:+--only "$OWNTESTS_ONLY"} \
        ${OWNTESTS_BASELINES:+--baselines "$OWNTESTS_BASELINES"}
fi

# ---- Numba's own CUDA tests (numba-cuda ships them) under Numba's manager and mempool's;
# numba.cuda.testing needs `filecheck`, whose wheel travels in .whl/ (installed above).
stage numbaown "$OUT/numba-own.log" timeout "$T_NUMBAOWN" "$PY" bench/numba_own_tests.py \
    "$OUT/numba-own" --suite "${NUMBAOWN_SUITE:-numba.cuda.tests.cudadrv}" \
    --timeout $((T_NUMBAOWN / 2 - 15))

# ---- summary
{
    cat "$OUT/versions.txt"
    echo
    for name in build tests sanitizer bench churn vmm fragmentation torch corpus allocpairs coldpairs snapshot owntests numbaown; do
        echo "stage $name: ${STATUS[$name]:-not run} (0 = passed; 124 = over its time limit)"
    done
    echo
    "$PY" - "$OUT" <<'EOF'
import glob, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "junit-*.xml"))):
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        print(f"{os.path.basename(path)}: unreadable ({exc}); the run was cut short")
        continue
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    print(f"{os.path.basename(path)}: {passed} passed, {totals['failures']} failed, "
          f"{totals['errors']} errors, {totals['skipped']} skipped")
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"  not passed: {case.get('classname')}::{case.get('name')}")
reports = glob.glob(os.path.join(out, "sanitizer-report.*.txt"))
errors = []
for path in reports:
    with open(path, errors="replace") as f:
        errors += [line.strip() for line in f if "ERROR SUMMARY" in line]
if reports:
    print("memcheck:", "; ".join(sorted(set(errors))) or "no summary line (cut short?)")
EOF
} 2>&1 | tee "$OUT/summary.txt"

# ---- the run's figures in the schema of bench/results/<card>.json
"$PY" bench/collect_results.py "$OUT" 2>&1 | tee -a "$OUT/summary.txt"
