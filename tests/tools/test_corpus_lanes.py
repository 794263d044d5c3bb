"""The trace corpus in lanes side by side (bench/corpus_lanes.py): the merged report holds what
one ``replay --corpus`` makes of the same traces, in the manifest's order, with the summary of
both halves over every lane; a lane that fails is named and its traces missing (on sim: no
GPU)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import corpus_lanes  # noqa: E402

CORPUS = os.path.join(ROOT, "mempool", "traces", "corpus")


def replay_corpus(folder):
    out = subprocess.run([sys.executable, "-m", "mempool", "replay", "--corpus", folder,
                          "--json"], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def test_lanes_make_what_one_replay_makes(tmp_path):
    out = tmp_path / "corpus.json"
    assert corpus_lanes.main([str(out), "--lanes", "3", "--processes", "1",
                              "--backend", "sim"]) == 0
    merged, whole = json.loads(out.read_text()), replay_corpus(CORPUS)
    assert [r["name"] for r in merged["rows"]] == [r["name"] for r in whole["rows"]]
    for got, want in zip(merged["rows"], whole["rows"]):
        for column, cell in want["cells"].items():
            assert got["cells"][column]["peak_reserved_bytes"] == cell["peak_reserved_bytes"]
    for half, summary in whole["summary"].items():
        assert merged["summary"][half]["traces"] == summary["traces"]
        for column in whole["columns"]:
            assert merged["summary"][half][column]["geomean_ratio"] == \
                pytest.approx(summary[column]["geomean_ratio"])
    dealt = [lane["traces"] for lane in merged["lanes"]]
    assert sorted(sum(dealt, [])) == sorted(r["name"] for r in whole["rows"])
    assert len(dealt) == 3 and all(lane["rc"] == 0 for lane in merged["lanes"])


def test_a_failed_lane_is_named_and_its_traces_missing(tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(CORPUS, corpus)
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["traces"] = [dict(t, file=os.path.basename(t["file"])) for t in
                          manifest["traces"] if not t["file"].startswith("..")][:4]
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    broken = manifest["traces"][1]
    (corpus / broken["file"]).write_bytes(b"not a trace")
    out = tmp_path / "corpus.json"
    assert corpus_lanes.main([str(out), "--corpus", str(corpus), "--lanes", "2",
                              "--processes", "1", "--backend", "sim"]) == 1
    merged = json.loads(out.read_text())
    failed = [lane for lane in merged["lanes"] if lane["rc"] != 0]
    assert len(failed) == 1 and broken["name"] in failed[0]["traces"]
    assert [r["name"] for r in merged["rows"]] == \
        [t["name"] for t in manifest["traces"] if t["name"] not in failed[0]["traces"]]


def test_each_lane_has_cpus_of_its_own():
    sets = corpus_lanes.cpu_sets(2)
    if None in sets:
        pytest.skip("fewer CPUs than lanes, or no CPU pinning here")
    assert not sets[0] & sets[1] and len(sets[0]) == len(sets[1])


@pytest.mark.parametrize("lanes", ["0", "65"])
def test_a_lane_count_out_of_range_is_refused(tmp_path, lanes, capsys):
    with pytest.raises(SystemExit) as exc:
        corpus_lanes.main([str(tmp_path / "x.json"), "--lanes", lanes, "--backend", "sim"])
    assert exc.value.code == 2
    assert "--lanes: expected a whole number from 1 to 64" in capsys.readouterr().err


def test_the_published_table_names_the_lanes_command(tmp_path):
    import collect_results
    out = tmp_path / "corpus.json"
    assert corpus_lanes.main([str(out), "--lanes", "2", "--processes", "2",
                              "--backend", "sim"]) == 0
    run = {"date": "2000-01-02", "commit": "abcdef0"}
    figures = collect_results.from_corpus(run, str(out))
    assert figures and {f["command"] for f in figures} == {
        "python bench/corpus_lanes.py FILE --lanes 2 --processes 2"}


def test_a_process_count_out_of_range_is_refused_before_any_lane_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        corpus_lanes.main([str(tmp_path / "x.json"), "--processes", "0", "--backend", "sim"])
    assert exc.value.code == 2
    assert "--processes: expected a whole number from 1 to 64" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
