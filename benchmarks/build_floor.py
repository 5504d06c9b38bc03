"""How much of ms.unroll's build time is TensorFlow's own: the floor a hand-written chain sets.

For blobs and the MLP with Adam, builds in a fresh graph and times (the median of 3):
- `ms.unroll`: N unrolled steps;
- `hand chain`: the same N steps written by hand the canonical TF1 way, each
  `loss_fn()` and `opt.minimize(...)` under `control_dependencies` of the previous
  step's train op (no checks, no names, no records);
- `forward+grads`: N times the forward pass and `tf.gradients` alone, unchained;
- `compile unrolled` / `compile loop`: the canonical single step built once, then
  `ms.compile` makes N copies of it (each imported from one GraphDef) or one loop body.
Building a step means creating its ops in TensorFlow's Python graph builder; the
hand chain is the least a graph of N real steps costs to build that way.

    taskset -c 0 python benchmarks/build_floor.py [--steps 10 100 1000] [--problems blobs mlp]
        [--builders ms.unroll "compile unrolled" "compile loop"]
"""

import argparse
import statistics
import time

import tensorflow as tf

import multistep as ms
from multistep.tools import bench

V1 = tf.compat.v1


def _unrolled(loss_fn, steps):
    ms.unroll(loss_fn, V1.train.AdamOptimizer(bench.LEARNING_RATE), steps,
              global_step=V1.train.get_or_create_global_step())


def _compiled(mode):
    def build(loss_fn, steps):
        """The canonical single step, once, then ms.compile: N copies or one loop body."""
        loss = loss_fn()
        train = V1.train.AdamOptimizer(bench.LEARNING_RATE).minimize(
            loss, global_step=V1.train.get_or_create_global_step())
        ms.compile([loss, train], steps, mode=mode)
    return build


def _hand_chain(loss_fn, steps):
    opt = V1.train.AdamOptimizer(bench.LEARNING_RATE)
    global_step = V1.train.get_or_create_global_step()
    train_op = None
    for k in range(steps):
        deps = [] if train_op is None else [train_op]
        with tf.control_dependencies(deps), V1.variable_scope(V1.get_variable_scope(), reuse=k > 0):
            train_op = opt.minimize(loss_fn(), global_step=global_step)


def _forward_grads(loss_fn, steps):
    for k in range(steps):
        with V1.variable_scope(V1.get_variable_scope(), reuse=k > 0):
            loss = loss_fn()
        tf.gradients(loss, V1.trainable_variables())


BUILDERS = {"ms.unroll": _unrolled, "hand chain": _hand_chain, "forward+grads": _forward_grads,
            "compile unrolled": _compiled("unrolled"), "compile loop": _compiled("while_loop")}


def build_s(problem, builder, steps, repeats=3):
    samples = []
    for _ in range(repeats):
        with tf.Graph().as_default():
            loss_fn = bench._graph_loss_fn(bench._problems()[problem])
            start = time.perf_counter()
            BUILDERS[builder](loss_fn, steps)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", nargs="+", choices=bench.PROBLEMS, default=list(bench.PROBLEMS))
    parser.add_argument("--steps", nargs="+", type=int, default=[10, 100, 1000])
    parser.add_argument("--builders", nargs="+", choices=list(BUILDERS), default=list(BUILDERS))
    args = parser.parse_args()
    print(f"{'problem':8} {'N':>5} " + " ".join(f"{b:>16}" for b in args.builders))
    for problem in args.problems:
        for steps in args.steps:
            times = {b: build_s(problem, b, steps, repeats=1 if steps >= 1000 else 3)
                     for b in args.builders}
            print(f"{problem:8} {steps:>5} " + " ".join(f"{times[b]:>15.2f}s" for b in args.builders),
                  flush=True)
