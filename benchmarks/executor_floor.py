"""Is ms.unroll's default mode at the TF executor's floor? A hand-written minimal graph beside it.

blobs (50 x 2 -> dense 2, softmax cross-entropy, Adam), N steps in one graph both ways:
- `ms.unroll`: unrolled mode, as a user builds it;
- `hand-written`: the same maths with the fewest ops: the forward pass, the closed-form
  gradient of softmax cross-entropy (dlogits = (softmax - onehot) / n, dW = x^T dlogits,
  db = sum dlogits) and Adam's apply, each step's reads after the previous apply.
Both run through `make_callable` on their train op, interleaved round by round in one
process (pinned to one core), median µs per step; and the executed nodes per step
(partition graphs, `multistep.compiler.kernels`).

    taskset -c 0 python benchmarks/executor_floor.py [--steps 10 100] [--rounds 9]
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import multistep as ms
from multistep.tools import blobs
from multistep.compiler import kernels

V1 = tf.compat.v1


def _variables():
    kernel = V1.get_variable("dense/kernel", [2, 2], initializer=V1.ones_initializer())
    bias = V1.get_variable("dense/bias", [2], initializer=V1.zeros_initializer())
    return kernel, bias


def unrolled(steps, x, y):
    def loss_fn():
        kernel, bias = _variables()
        logits = tf.matmul(x, kernel) + bias
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return ms.unroll(loss_fn, V1.train.AdamOptimizer(0.01), steps, nonfinite="ignore").train_op


def hand_written(steps, x, y):
    kernel, bias = _variables()
    opt = V1.train.AdamOptimizer(0.01)
    onehot, n, xt = tf.one_hot(y, 2), float(len(y)), tf.constant(x.T)
    train_op = None
    for _ in range(steps):
        with tf.control_dependencies([] if train_op is None else [train_op]):
            w, b = kernel.read_value(), bias.read_value()
        dlogits = (tf.nn.softmax(tf.matmul(x, w) + b) - onehot) / n
        train_op = opt.apply_gradients([(tf.matmul(xt, dlogits), kernel),
                                        (tf.reduce_sum(dlogits, 0), bias)])
    return train_op


BUILDERS = {"ms.unroll": unrolled, "hand-written": hand_written}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", type=int, default=[10, 100])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    x, y = blobs.data(0)
    print(f"{'N':>5} {'method':<13} {'µs/step':>9} {'nodes/step':>11}")
    for steps in args.steps:
        runners, nodes = {}, {}
        for name, build in BUILDERS.items():
            graph = tf.Graph()
            with graph.as_default():
                op = build(steps, x, y.astype(np.int32))
                init = V1.global_variables_initializer()
            sess = V1.Session(graph=graph)
            sess.run(init)
            _, executed = kernels.executed(sess, op)
            nodes[name] = len(executed) / steps
            runners[name] = (sess, sess.make_callable(op))
        samples = {name: [] for name in BUILDERS}
        for _ in range(args.rounds):  # interleaved: a shared machine slows both alike
            for name, (_, call) in runners.items():
                calls, start = 0, time.perf_counter()
                while calls == 0 or time.perf_counter() - start < 0.2:
                    call()
                    calls += 1
                samples[name].append((time.perf_counter() - start) / (calls * steps) * 1e6)
        for name in BUILDERS:
            print(f"{steps:>5} {name:<13} {statistics.median(samples[name]):>9.2f} "
                  f"{nodes[name]:>11.1f}", flush=True)
        for sess, _ in runners.values():
            sess.close()


if __name__ == "__main__":
    main()
