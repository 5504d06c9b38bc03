"""`ms.tf2.fuse` fed from a `tf.data` iterator against the original custom loop.

A Keras 3 model of each of `multistep bench`'s problems (blobs: dense 2 -> 2; mlp:
32 -> 256 -> 256 -> 2), Adam, minibatches of 32 from `Dataset.from_tensor_slices(...)
.batch(32, drop_remainder=True).repeat()`. The original: keras-io's custom training
loop, one `tf.function(step)` call per batch, each batch taken by the loop's own
`next(iterator)`. Fused: `ms.tf2.fuse(step, N)(iterator)`, N batches a call, taken by the
fused call itself. Pre-stacked: the same fused steps on N batches stacked beforehand (the
fetching left out; what fusing the steps alone gains). One process, each its own model
and iterator; the turns alternate round by round, the order rotated each round, so a slow
moment of the shared machine hits all alike. Prints each one's median µs per step and the
median of the rounds' own ratios to the original (the paired figure).

    taskset -c 1 python benchmarks/tf2_data.py [--problems blobs mlp] [--steps 8] [--rounds 15]
"""

import argparse
import statistics
import time

import keras
import tensorflow as tf

import multistep as ms
from multistep.tools import bench

BATCH = 32


def _step(problem):
    model = bench._keras_model(problem, 1, False)
    optimizer = model.optimizer
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            loss = xent(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    return step


def _iterator(problem):
    data = tf.data.Dataset.from_tensor_slices((problem.x, problem.y))
    return iter(data.batch(BATCH, drop_remainder=True).repeat())


def _runners(problem, steps):
    """name -> run(calls): ``calls * steps`` training steps, the last loss read."""
    single, original = tf.function(_step(problem)), _iterator(problem)

    def run_original(calls):
        for _ in range(calls * steps):
            loss = single(next(original))
        loss.numpy()

    fused, fed = ms.tf2.fuse(_step(problem), steps), _iterator(problem)

    def run_fused(calls):
        for _ in range(calls):
            out = fused(fed)
        out["loss"].numpy()

    stacked = ms.tf2.fuse(_step(problem), steps)
    source = _iterator(problem)
    blocks = [tf.nest.map_structure(lambda *xs: tf.stack(xs),
                                    *[next(source) for _ in range(steps)]) for _ in range(8)]

    def run_stacked(calls):
        for c in range(calls):
            out = stacked(blocks[c % len(blocks)])
        out["loss"].numpy()

    return {"original": run_original, "fuse(iterator)": run_fused,
            "fuse(pre-stacked)": run_stacked}


def per_step_us(problem, steps, rounds, calls):
    runners = _runners(problem, steps)
    times = {name: [] for name in runners}
    for r in range(rounds + 1):  # round 0: traces
        order = list(runners.items())
        for name, run in order[r % len(order):] + order[:r % len(order)]:
            start = time.perf_counter()
            run(calls)
            if r:
                times[name].append((time.perf_counter() - start) / (calls * steps) * 1e6)
    out = {name: statistics.median(t) for name, t in times.items()}
    paired = {name: statistics.median(o / t for o, t in zip(times["original"], times[name]))
              for name in runners if name != "original"}
    return out, paired


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", choices=bench.PROBLEMS,
                        default=list(bench.PROBLEMS))
    parser.add_argument("--steps", nargs="+", type=int, default=[8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50, help="fused calls a round")
    args = parser.parse_args()
    print(f"{'problem':8s} {'N':>3s} {'original µs':>12s} {'fuse(iterator) µs':>18s} "
          f"{'paired':>7s} {'fuse(pre-stacked) µs':>21s} {'paired':>7s}")
    problems = bench._problems()
    for name in args.problems:
        for steps in args.steps:
            us, paired = per_step_us(problems[name], steps, args.rounds, args.calls)
            print(f"{name:8s} {steps:3d} {us['original']:12.1f} {us['fuse(iterator)']:18.1f} "
                  f"{paired['fuse(iterator)']:6.2f}x {us['fuse(pre-stacked)']:21.1f} "
                  f"{paired['fuse(pre-stacked)']:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
