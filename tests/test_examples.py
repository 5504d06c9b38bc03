"""Every script in examples/ runs to completion (they are small by design)."""

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
EXPECTED = {  # a line each example must print: evidence it did its job
    "as_written.py": "all three programs: bitwise equal",  # exit 1 unless each is
    "batch_norm.py": "(weights, slots, moving statistics): all bitwise equal",
    "blobs_three_steps.py": "refused: ",
    "ema_and_projection.py": "OK",
    "gan.py": "simultaneous: 20 steps of D then G (4 runs of 5) against single steps: max |Δ| = 0 "
              "(bitwise equal)",  # exit 1 unless the chained steps are bitwise too
    "verify_my_model.py": "(bitwise equal)",
    "monitored_training.py": "same checkpoint steps, same per-step summaries, weights and slots "
                             "bitwise equal; resumed run bitwise equal",
    "clipped_adam.py": "Adam accumulated the clipped gradients",
    "compact_domain_sgd.py": "(bitwise equal)",
    "deferred_loop.py": "as written and deferred: bitwise equal",  # exit 1 unless they are
    "two_replicas.py": "max |Δ| = 0 (bitwise equal), atol = 0: OK",
    "two_workers.py": "workers 0 and 1: max |Δ| = 0 (bitwise equal)",  # exit 1 unless all are
    "tf2_fuse.py": "max |Δ| = 0 (bitwise equal), atol = 0: OK",
    "keras_step_history.py": "12 steps in 2 executions; per-step loss:",
    "sparse_embedding_clipping.py": "ms.clip_by_value(-4, 4), sparse: rows after one step [4. 0. 1.]",
}


def test_every_example_is_listed():
    assert sorted(os.path.basename(p) for p in EXAMPLES) == sorted(EXPECTED)


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_runs(path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, path], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert EXPECTED[os.path.basename(path)] in result.stdout
