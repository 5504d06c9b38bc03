"""The loop shapes of tests/deferred_cases.py as one training script, written with plain
sessions: what `multistep run` and `multistep verify` take unchanged (the test of
`multistep verify` runs it as written twice and under `multistep run` once)."""
import os
import sys

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tf.compat.v1.disable_eager_execution()

import deferred_cases  # noqa: E402

for name, case in sorted(deferred_cases.CASES.items()):
    variables, reads, _ = case(lambda g: tf.compat.v1.Session(graph=g)
                               if isinstance(g, tf.Graph) else g)
    print(name, len(variables), [repr(r) for r in reads][:2])
