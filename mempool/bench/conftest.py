"""pytest configuration of the latency suite (see README.md in this folder).

``pytest bench --benchmark-enable`` times everything and prints, after pytest-benchmark's
own tables, one summary: ns per pair by contender and size with each row's ratio to mempool.
Without ``--benchmark-enable`` (the project's default addopts disable benchmarks) every
benchmark runs its loop once, briefly, as a plain test.
"""
import pytest

from .benchkit import gpu_available, pairs_for


def pytest_configure(config):
    # Registered here as well as in pyproject.toml: an installed package runs the suite
    # without the project's configuration.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


@pytest.fixture
def pairs(benchmark):
    """Pairs per timed round (a handful when benchmarks are disabled)."""
    return pairs_for(benchmark)


def pytest_report_header(config):
    found = "found" if gpu_available() else "not found: the GPU rows skip"
    return f"mempool bench: CUDA device {found}"


def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    from mempool.cli.bench import render_table

    infos = [b.extra_info for b in session.benchmarks if b.extra_info.get("ns")]
    if infos:
        terminalreporter.write_sep("-", "mempool bench summary")
        terminalreporter.write_line(render_table(infos))
