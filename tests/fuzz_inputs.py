"""The fuzzer's hostile inputs (the ``inputs`` target of tests/fuzz_surface_driver.py):
trace files (gzip bombs under a lowered cap, deep nesting, bad types and signs, damaged
gzip, odd snapshots and CSV logs) for every reader, hostile conf strings for the parser, and
command lines run in process. Every reader's error must be one short ValueError line (an
OSError only where a file cannot be opened); every command's error one line on stderr."""
import os

from hypothesis import given
from hypothesis import strategies as st

import mempool
from mempool import _config

LOG = None          # the driver's call log, set by make_test


# The readers' bound, lowered so that a bomb that passes it stays small (CI runs this).
INPUT_CAP = 1 << 20
HEADER = b'{"format": "mempool-trace", "version": 1}'
EVENT = b'["alloc", 1, 512, 0, 0]'


def hostile_files():
    """(name, bytes) of files a reader may be handed: bombs, deep nesting, bad types and
    signs, damaged gzip, odd snapshots and CSV logs."""
    import gzip
    import pickle
    depth = st.sampled_from([1, 10, 64, 65, 1000, 100_000])
    json_value = st.recursive(
        st.one_of(st.integers(-2 ** 70, 2 ** 70), st.text(max_size=4), st.none(),
                  st.booleans(), st.floats()),
        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                st.dictionaries(st.text(max_size=4), inner, max_size=3)),
        max_leaves=8)

    def jsonish(v):
        import json
        return json.dumps(v).encode()

    nested = depth.map(lambda d: b"[" * d + b"]" * d)
    header_with = st.tuples(st.sampled_from(["step_starts", "events", "version", "x"]),
                            json_value).map(
        lambda kv: b'{"format": "mempool-trace", "version": 1, "' + kv[0].encode()
        + b'": ' + jsonish(kv[1]) + b"}")
    event_line = st.one_of(json_value.map(jsonish), nested, st.just(EVENT),
                           st.binary(max_size=40))
    trace = st.tuples(st.one_of(st.just(HEADER), header_with,
                                nested.map(lambda n: HEADER[:-1] + b', "x": ' + n + b"}")),
                      st.lists(event_line, max_size=4)).map(
        lambda hv: b"\n".join([hv[0], *hv[1]]) + b"\n")
    bomb = st.integers(INPUT_CAP // 2, 2 * INPUT_CAP).map(
        lambda n: gzip.compress(HEADER + b"\n" + b'["free",1,0,0,0]\n' * (n // 17)))
    snapshot = st.one_of(
        json_value, st.fixed_dictionaries({"device_traces": json_value}),
        st.fixed_dictionaries({"device_traces": st.lists(st.lists(json_value, max_size=3),
                                                         max_size=2),
                               "segments": json_value}),
    ).map(pickle.dumps)
    rmm_field = st.one_of(st.sampled_from(["-1", "+1", "0x10", "1_0", "(nil)", "9" * 200_000,
                                           "", '"', "00:00:01.5", "-1:00:00"]),
                          st.text(max_size=6))
    rmm = st.lists(st.tuples(rmm_field, rmm_field, rmm_field, rmm_field), max_size=3).map(
        lambda rows: ("Thread,Time,Action,Pointer,Size,Stream\n" + "".join(
            f"1,{t},{a},{p},{z},0\n" for t, a, p, z in rows)).encode("utf-8", "replace"))
    gz = st.one_of(trace, snapshot).map(gzip.compress)
    return st.one_of(
        st.tuples(st.just("trace.jsonl"), trace),
        st.tuples(st.just("bomb.jsonl.gz"), bomb),
        st.tuples(st.just("snap.pickle"), snapshot),
        st.tuples(st.just("log.csv"), rmm),
        st.tuples(st.just("cut.gz"), st.tuples(gz, st.integers(0, 200)).map(
            lambda gc: gc[0][:max(0, len(gc[0]) - 1 - gc[1])])),
        st.tuples(st.just("flipped.gz"), st.tuples(gz, st.integers(0, 1 << 16)).map(
            lambda gi: gi[0][:gi[1] % len(gi[0])] + bytes([gi[0][gi[1] % len(gi[0])] ^ 0xFF])
            + gi[0][gi[1] % len(gi[0]) + 1:])),
        st.tuples(st.just("bytes.bin"), st.binary(max_size=64)),
    )


def hostile_confs(conf_strings, strings):
    """Conf strings: long repeats, '=' for ':', brackets, odd values."""
    keys = sorted(_config.OPTIONS) + ["max_split_size_mb", "bogus"]
    piece = st.one_of(
        conf_strings,
        st.tuples(st.sampled_from(keys), st.sampled_from(strings)).map(
            lambda kv: f"{kv[0]}={kv[1]}"),
        st.sampled_from(["[", "]", ":", ",", "[256:1,>:8", "limit:-1", "limit:0GB",
                         "limit:2097151"]),
    )
    return st.tuples(st.lists(piece, max_size=4).map(",".join),
                     st.sampled_from([1, 2, 1000, 16384])).map(lambda cr: cr[0] * cr[1]
                                                               if len(cr[0]) * cr[1] < 1 << 21
                                                               else cr[0])


def _cli_line(argv):
    """Run ``python -m mempool ARGV`` in this process: an error must be one line, exit
    status 2 (or 1: tune found nothing that fits)."""
    import contextlib
    import io
    import mempool.cli
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = mempool.cli.main(argv)
        except SystemExit as exc:          # argparse's usage errors
            rc = exc.code
    text = err.getvalue()
    if rc not in (0, 1, 2) or "Traceback" in text or (rc and len(text.strip().splitlines())
                                                        != 1):
        raise AssertionError(f"python -m mempool {' '.join(argv)}: exit status {rc}, "
                             f"stderr {text[-1500:]!r}")


def step(data, tmpdir, confs):
    from mempool.tools import trace as mt
    kind = data.draw(st.sampled_from(["file", "conf", "cli-file", "cli-args"]), label="input")
    if kind == "conf":
        conf = data.draw(confs, label="conf")
        LOG.write(f"parse_conf({conf[:300]!r}) ({len(conf)} characters)")
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                _config.parse_conf(conf)
            except (ValueError, TypeError) as exc:
                if "\n" in str(exc) or len(str(exc)) > 2000:
                    raise AssertionError(f"parse_conf's error is not one short line: "
                                         f"{str(exc)[:300]!r}") from exc
        return
    if kind == "cli-args":
        # A small trace first, so that no call replays the large default one.
        small = os.path.join(os.path.dirname(mempool.__file__), "traces", "small.jsonl")
        argv = [data.draw(st.sampled_from(["replay", "plot"]), label="command"), small]
        argv += data.draw(st.lists(st.sampled_from(
            ["--limit", "0", "-1", "x", "0.5", "--conf", "limit=1", "limit:-1", "--backend",
             "host", "--top", "--debug-no", "/", os.devnull]), max_size=4), label="argv")
        LOG.write(f"cli {argv!r}")
        _cli_line(argv)
        return
    name, content = data.draw(hostile_files(), label="file")
    path = os.path.join(tmpdir, name)
    with open(path, "wb") as f:
        f.write(content)
    reader = data.draw(st.sampled_from(["load_any", "load", "from_torch_snapshot",
                                        "from_rmm_csv"]), label="reader")
    if kind == "cli-file":
        LOG.write(f"cli replay {name} ({len(content)} bytes)")
        _cli_line(["replay", path])
        return
    LOG.write(f"mempool.tools.trace.{reader}({name}) ({len(content)} bytes)")
    try:
        getattr(mt, reader)(path)
    except ValueError as exc:
        if "\n" in str(exc) or len(str(exc)) > 2000:
            raise AssertionError(f"{reader}'s error is not one short line: "
                                 f"{str(exc)[:300]!r}") from exc


def make_test(tmpdir, log, conf_strings, strings):
    """The hypothesis test of one batch: a few hostile inputs an example; `log` is the
    driver's call log, `conf_strings` and `strings` its strategies and odd strings."""
    from mempool.tools import trace as mt
    global LOG
    LOG = log
    mt.MAX_INPUT_BYTES = INPUT_CAP
    confs = hostile_confs(conf_strings, strings)

    @given(st.data())
    def example(data):
        for _ in range(data.draw(st.integers(1, 4), label="steps")):
            step(data, tmpdir, confs)
    return example
