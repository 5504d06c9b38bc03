"""Why fusing saves what it saves: executed ops per step and µs per op, from RunMetadata.

For blobs with Adam: one sess.run of a stock minimize, ms.unroll at N = 100 (with and
without the non-finite check), loop mode at N = 100, and unrolled at N = 1000.

    taskset -c 0 python benchmarks/executor_profile.py
"""

import time

import numpy as np
import tensorflow as tf

import multistep as ms
from multistep.tools import bench

V1 = tf.compat.v1


def per_step_us(sess, op, steps):
    for _ in range(20):
        sess.run(op)
    calls = max(1, 2000 // steps)
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            sess.run(op)
        samples.append((time.perf_counter() - start) / calls / steps * 1e6)
    return float(np.median(samples))


def executed_nodes(sess, op):
    metadata = V1.RunMetadata()
    sess.run(op, options=V1.RunOptions(trace_level=V1.RunOptions.FULL_TRACE), run_metadata=metadata)
    return sum(len(d.node_stats) for d in metadata.step_stats.dev_stats)


def main():
    problem = bench._problems()["blobs"]
    cases = [("sess.run minimize", 1, None), ("unrolled", 100, {}),
             ("unrolled nonfinite=ignore", 100, {"nonfinite": "ignore"}),
             ("while_loop", 100, {"mode": "while_loop"}), ("unrolled", 1000, {})]
    for label, steps, options in cases:
        with tf.Graph().as_default():
            gs = V1.train.get_or_create_global_step()
            loss_fn = bench._graph_loss_fn(problem)
            if options is None:
                op = V1.train.AdamOptimizer(0.01).minimize(loss_fn(), global_step=gs)
            else:
                op = ms.unroll(loss_fn, V1.train.AdamOptimizer(0.01), steps, global_step=gs,
                               **options).train_op
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                us, nodes = per_step_us(sess, op, steps), executed_nodes(sess, op)
        print(f"{label:<28} N={steps:<5} {us:7.2f} µs/step  {nodes / steps:6.1f} executed nodes/step  "
              f"{us * steps / nodes:5.2f} µs/node")


if __name__ == "__main__":
    main()
