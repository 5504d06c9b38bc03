"""The benchmark harness runs end to end. No timing is asserted: the numbers are the
benchmark's to report, not the tests' to check."""

import csv
import os
import subprocess
import sys

from multistep import bench

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
    assert "speed-up vs sess.run x N" in out and "peak KiB" in out
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(bench.METHODS)
    assert all(float(r["median_us"]) > 0 for r in rows if r["method"] != "keras spe=N")
    with open(tmp_path / "graph.csv") as f:
        costs = list(csv.DictReader(f))
    assert {(c["mode"], c["steps"]) for c in costs} == {(m, n) for m in ("unrolled", "while_loop")
                                                       for n in ("1", "10")}


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
