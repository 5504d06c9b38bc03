"""What `ms.keras.StepHistory` costs a step under `fit(steps_per_execution=N)`.

A Keras 3 model of each of `multistep bench`'s problems (blobs: dense 2 -> 2; mlp:
32 -> 256 -> 256 -> 2), Adam, the full batch repeated, fit in turns with a do-nothing
callback and with `StepHistory()` (which keeps its traced train function between fits:
neither fit retraces after the first round). A clock callback (last) marks the end of
every execution; a fit's time per step is the time between those marks (fit's start-up
and its first execution left out). The turns alternate round by round, the order
rotated each round, so a slow moment of the shared machine hits both alike. Prints the
median µs per step of each, their ratio, the median of the rounds' own ratios (each
round's two fits ran back to back: the paired figure, which a slow stretch of the shared
machine moves least), and the median time StepHistory's own `on_train_batch_end` takes
an execution.

    taskset -c 0 python benchmarks/step_history.py [--problems blobs mlp] [--steps 4 16 64]
"""

import argparse
import statistics
import time

import keras
import tensorflow as tf

import multistep as ms
from multistep.tools import bench


class _Nothing(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


def per_step_us(problem, steps, rounds):
    data = tf.data.Dataset.from_tensors((problem.x, problem.y)).repeat()
    executions = max(3, problem.keras_steps // steps)
    history = ms.keras.StepHistory()
    hook, spent = history.on_train_batch_end, []

    def timed(batch, logs=None):  # the callback's own time between executions
        start = time.perf_counter()
        hook(batch, logs)
        spent.append(time.perf_counter() - start)
    history.on_train_batch_end = timed
    # One model (compile's default jit_compile), its fits alternating: no model's own luck.
    model = bench._keras_model(problem, steps, "auto")
    fits = {"fit": (model, _Nothing()), "fit + StepHistory": (model, history)}
    times = {name: [] for name in fits}
    for r in range(rounds + 1):  # round 0: traces
        order = list(fits.items())
        for name, (model, callback) in order[r % 2:] + order[:r % 2]:
            clock = bench._execution_clock()
            model.fit(data, steps_per_epoch=executions * steps, epochs=1, verbose=0,
                      shuffle=False, callbacks=[callback, clock])
            if r:
                times[name].append(clock.us_per_step(steps))
    out = {name: statistics.median(t) for name, t in times.items()}
    out["paired"] = statistics.median(
        h / f for h, f in zip(times["fit + StepHistory"], times["fit"]))
    out["callback"] = statistics.median(spent) * 1e6
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", choices=bench.PROBLEMS,
                        default=list(bench.PROBLEMS))
    parser.add_argument("--steps", nargs="+", type=int, default=[4, 16, 64])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"{'problem':8s} {'N':>3s} {'fit µs':>9s} {'+StepHistory µs':>16s} {'cost':>7s} "
          f"{'paired':>7s} {'its hook µs/execution':>22s}")
    problems = bench._problems()
    for name in args.problems:
        for steps in args.steps:
            us = per_step_us(problems[name], steps, args.rounds)
            plain, history = us["fit"], us["fit + StepHistory"]
            print(f"{name:8s} {steps:3d} {plain:9.1f} {history:16.1f} "
                  f"{100 * (history / plain - 1):+6.1f}% {100 * (us['paired'] - 1):+6.1f}% "
                  f"{us['callback']:22.1f}", flush=True)


if __name__ == "__main__":
    main()
