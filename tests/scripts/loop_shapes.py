"""The loop shapes of tests/deferred_cases.py as one training script, written with plain
sessions: what `multistep run` and `multistep verify` take unchanged (the test of
`multistep verify` runs it as written twice and under `multistep run` once).

The tf.data case is left out: deferred, its input runs out one run call later than as
written (the loop ran past the failing step, which the deferred session warns of), so the
two scripts make different numbers of run calls by design."""
import os
import sys

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tf.compat.v1.disable_eager_execution()

import deferred_cases  # noqa: E402

for name, case in sorted(deferred_cases.CASES.items()):
    if name == "data":
        continue
    variables, reads, _ = case(lambda g: tf.compat.v1.Session(graph=g)
                               if isinstance(g, tf.Graph) else g)
    print(name, len(variables), [repr(r) for r in reads][:2])
