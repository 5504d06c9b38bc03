"""The benchmark harness runs end to end. No timing is asserted: the numbers are the
benchmark's to report, not the tests' to check."""

import csv
import os
import re
import subprocess
import sys

from multistep.tools import bench
from multistep import choices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_quick_smoke(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "multistep", "bench", "--quick", "--cpu", "-1",
                             "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for method in bench.METHODS:
        assert f"blobs       1  {method}" in out and f"blobs      10  {method}" in out, method
    assert "vs sess.run x N" in out and "vs make_callable x N" in out and "peak KiB" in out
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(bench.METHODS)
    skipped = [r for r in rows if r["note"].startswith("skipped")]
    assert all(r["method"].startswith("jax fori_loop") for r in skipped)  # only without [bench]
    rows = [r for r in rows if r not in skipped]
    for r in rows:  # every method, Keras included: a time is positive and its quartiles order
        assert 0 < float(r["low_us"]) <= float(r["median_us"]) <= float(r["high_us"]), r
    # Every printed time and quartile is a plain positive number (a "-" sign would not parse).
    printed = re.findall(r"^blobs +\d+  (.+?) +(\d+\.\d+) +(\d+\.\d+)-(\d+\.\d+) ", out, re.M)
    assert len(printed) == len(rows) and all(float(x) > 0 for row in printed for x in row[1:])
    with open(tmp_path / "graph.csv") as f:
        costs = list(csv.DictReader(f))
    assert {(c["mode"], c["steps"]) for c in costs} == {(m, n) for m in ("unrolled", "while_loop")
                                                       for n in ("1", "10")}
    assert all(int(c["peak_bytes"]) > 0 for c in costs)


def test_the_command_line_lists_every_method_and_problem():
    assert tuple(bench.METHODS) == choices.BENCH_METHODS
    assert bench.PROBLEMS == choices.BENCH_PROBLEMS


def test_a_figure_with_a_spread_larger_than_itself_gets_no_ratio():
    rows = [bench.Result("blobs", 10, "sess.run x N", 10.0, 9.0, 11.0),
            bench.Result("blobs", 10, "unrolled", 2.0, 1.0, 4.0),      # IQR 3 > 2
            bench.Result("blobs", 10, "while_loop", 2.0, 1.5, 2.5)]
    lines = bench.table(rows).splitlines()
    assert "unreliable" in lines[2] and not re.search(r"\dx", lines[2])
    assert "5.00x" in lines[3]
    noisy_base = [bench.Result("blobs", 1, "sess.run x N", 10.0, 1.0, 30.0),
                  bench.Result("blobs", 1, "unrolled", 2.0, 1.9, 2.1)]
    assert "base unreliable" in bench.table(noisy_base).splitlines()[2]


def test_loop_mode_node_count_is_flat_and_unrolled_grows():
    small, large = (bench.graph_costs("blobs", "while_loop", n) for n in (2, 50))
    assert small["nodes"] == large["nodes"]
    assert bench.graph_costs("blobs", "unrolled", 50)["nodes"] > 10 * small["nodes"]


def test_plot_writes_a_png_when_matplotlib_is_installed(tmp_path):
    results = [bench.Result("blobs", n, m, 10.0 / n, 9.0 / n, 11.0 / n)
               for n in (1, 10) for m in ("sess.run x N", "unrolled")]
    path = bench.plot(results, str(tmp_path / "bench.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert path is None  # the CLI then says how to get the plot
        return
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_unrolled_xla_is_skipped_past_its_compile_budget():
    result = bench.time_method("blobs", "unrolled+xla", bench.MAX_UNROLLED_XLA_STEPS + 1)
    assert result.note.startswith("skipped")


def test_the_methods_of_one_problem_and_n_take_turns(monkeypatch):
    """Each method is built and warmed up, then the methods take turns for their repeats
    (the order rotated each round), and each method's session is closed at the end: a
    slow stretch of a shared machine falls on all of them."""
    log = []

    def method(name):
        def generator(problem, steps, timing):
            log.append(f"build {name}")
            try:
                while True:
                    log.append(name)
                    yield float(len(log))
            finally:
                log.append(f"close {name}")
        return generator

    def missing(problem, steps, timing):
        raise bench._Skipped("skipped: not installed")
        yield

    monkeypatch.setattr(bench, "METHODS", {"a": method("a"), "b": method("b"), "c": missing})
    results = bench.run(["blobs"], [2], ["a", "b", "c"], repeats=3)
    assert log == ["build a", "a", "build b", "b",  # built, warmed up, first repeat
                   "b", "a", "a", "b",  # rounds 2 and 3, the order rotated
                   "close a", "close b"]
    assert [r.method for r in results] == ["a", "b", "c"]
    assert results[0].median_us == 6.0  # a's samples: 2, 6, 7
    assert results[2].note == "skipped: not installed"
