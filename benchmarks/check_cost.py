"""What `nonfinite="raise"`'s check costs a step, on the four models of `models.py`.

Runs `ms.unroll` (unrolled, the default checks) with a full trace (RunMetadata step
stats) and sums the kernel time of the ops under each step's `check/` scope against the
kernel time of all ops: the check's share of a step's executed work (the time between
kernels, the executor's own, is not counted on either side).

    taskset -c 0 python benchmarks/check_cost.py [--steps 4] [--runs 5]
"""

import argparse

import tensorflow as tf

import models

V1 = tf.compat.v1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"{'model':12s} {'check µs/step':>14s} {'all ops µs/step':>16s} {'share':>7s}")
    for model in models.MODELS:
        graph, init, fetch, _, _ = models.build("ms.unroll", model, args.steps)
        with graph.as_default(), V1.Session(graph=graph) as sess:
            sess.run(init)
            sess.run(fetch)  # (the first run: Grappler, allocations)
            check = total = 0
            for _ in range(args.runs):
                metadata = V1.RunMetadata()
                sess.run(fetch, options=V1.RunOptions(trace_level=V1.RunOptions.FULL_TRACE),
                         run_metadata=metadata)
                for device in metadata.step_stats.dev_stats:
                    for node in device.node_stats:
                        micros = node.op_end_rel_micros - node.op_start_rel_micros
                        total += micros
                        check += micros if "/check/" in node.node_name else 0
        steps = args.runs * args.steps
        print(f"{model:12s} {check / steps:14.1f} {total / steps:16.1f} "
              f"{100 * check / total:6.1f}%")


if __name__ == "__main__":
    main()
