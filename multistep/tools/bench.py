"""Benchmark harness: per-step time of ``ms.unroll``'s modes against the alternatives.

Every method trains the same model with the same optimizer class
(``tf.compat.v1.train.AdamOptimizer``, Keras' Adam for Keras) and is timed side
by side in one process, after a warm-up, as the median over repeats of the
wall time per optimizer step. The methods of one problem and N take turns, repeat by
repeat (each a generator that keeps its model and session between its repeats), so a
slow stretch of a shared machine falls on all of them rather than on one. Ratios are
against N separate ``sess.run`` calls of a stock ``minimize`` op. Results are printed,
never asserted.

Problems:
  blobs  make_blobs 50 x 2 -> dense 2 (overhead-bound: the maths is tiny)
  mlp    512 x 32 -> 256 -> 256 -> 2, relu (compute-bound)
"""

import csv
import dataclasses
import functools
import statistics
import time

import numpy as np
import tensorflow as tf

from multistep.choices import BENCH_PROBLEMS
from multistep.compiler.compile import CHUNK, compile  # noqa: A004
from multistep.builder.unroll import unroll

__all__ = ["METHODS", "PROBLEMS", "Result", "graph_costs", "graph_table", "plot", "run", "table",
           "time_method", "write_csv"]

V1 = tf.compat.v1
LEARNING_RATE = 0.01


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    x: np.ndarray
    y: np.ndarray
    layers: tuple  # hidden widths, then the output width
    keras_steps: int  # steps per timed Keras fit(): enough to swamp its fixed cost


def _problems():
    from multistep.tools import blobs

    x, y = blobs.data(0)
    rng = np.random.RandomState(0)
    mlp_x = rng.randn(512, 32).astype(np.float32)
    mlp_y = (mlp_x[:, 0] > 0).astype(np.int32)
    return {"blobs": Problem("blobs", x, y, (2,), keras_steps=4000),
            "mlp": Problem("mlp", mlp_x, mlp_y, (256, 256, 2), keras_steps=200)}


PROBLEMS = BENCH_PROBLEMS


def _initial_values(problem):
    rng = np.random.RandomState(1)
    shapes, width = [], problem.x.shape[1]
    for units in problem.layers:
        shapes.append((width, units))
        width = units
    if problem.name == "blobs":
        return [(np.ones(s, np.float32), np.zeros(s[1], np.float32)) for s in shapes]
    return [((rng.randn(*s) / np.sqrt(s[0])).astype(np.float32), np.zeros(s[1], np.float32))
            for s in shapes]


def _forward(problem, weights, x):
    h = x
    for i, (w, b) in enumerate(weights):
        h = tf.matmul(h, w) + b
        if i < len(weights) - 1:
            h = tf.nn.relu(h)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=problem.y, logits=h))


def _graph_loss_fn(problem):
    init = _initial_values(problem)

    def loss_fn():
        weights = [(V1.get_variable(f"layer{i}/kernel", initializer=w),
                    V1.get_variable(f"layer{i}/bias", initializer=b)) for i, (w, b) in enumerate(init)]
        return _forward(problem, weights, problem.x)
    return loss_fn


@dataclasses.dataclass(frozen=True)
class _Timing:
    min_repeat_s: float
    keras_steps: int = 4000

    def samples(self, step_fn, steps):
        """µs per optimizer step of ``step_fn`` (which performs ``steps``): one sample (a
        repeat) each time the generator is resumed, without end.

        The first call is a warm-up (allocation, XLA compilation); a repeat
        makes as many calls as fill ``min_repeat_s``.
        """
        step_fn()
        start, calls = time.perf_counter(), 0
        while calls == 0 or time.perf_counter() - start < self.min_repeat_s:
            step_fn()
            calls += 1
        while True:
            start = time.perf_counter()
            for _ in range(calls):
                step_fn()
            yield (time.perf_counter() - start) / (calls * steps) * 1e6


def _v1_method(mode, xla):
    def method(problem, steps, timing):
        with tf.Graph().as_default() as graph:
            gs = V1.train.get_or_create_global_step()
            optimizer = V1.train.AdamOptimizer(LEARNING_RATE)
            if mode in ("sess.run", "make_callable"):
                op, calls = optimizer.minimize(_graph_loss_fn(problem)(), global_step=gs), steps
            elif mode.startswith("compile "):  # the single step, then ms.compile
                loss = _graph_loss_fn(problem)()
                op = compile([loss, optimizer.minimize(loss, global_step=gs)], steps,
                             mode=mode.split()[1], xla=xla)
                calls = 1
            else:
                op = unroll(_graph_loss_fn(problem), optimizer, steps, global_step=gs, mode=mode,
                            xla=xla)
                calls = 1
            init = V1.global_variables_initializer()
        graph.finalize()
        # Not the graph's or the session's `with`: the generator stops between repeats
        # while the other methods run, and those contexts are per-thread stacks.
        sess = V1.Session(graph=graph)
        try:
            sess.run(init)
            # make_callable: the fastest way TF1 runs a fixed fetch, with sess.run's
            # argument handling done once. Fused: Unrolled.run, as a user runs it (its
            # losses fetched; through a cached make_callable).
            if mode == "make_callable":
                call = sess.make_callable(op)
            elif mode == "sess.run":
                call = lambda: sess.run(op)
            else:
                call = lambda: op.run(sess)

            def run_steps():
                for _ in range(calls):
                    call()
            yield from timing.samples(run_steps, steps)
        finally:
            sess.close()
    return method


def _floor_method(losses):
    """The floor: a minimal TF1 XLA while loop of the same maths. One
    ``tf.function(jit_compile=True)`` called from the graph, whose ``tf.while_loop``
    body is the forward pass, ``tf.gradients`` and Adam's apply; run through
    ``make_callable`` on its one output: the loop's counter, or with ``losses`` every
    step's loss, kept the fastest way found: in chunks of ``compile.CHUNK`` steps (an inner
    loop writes a chunk's losses into an ``f32[CHUNK]`` tensor, within the 512 bytes
    XLA:CPU's sequential executor takes), stacked by an outer loop."""
    def method(problem, steps, timing):
        with tf.Graph().as_default() as graph:
            weights = [(V1.get_variable(f"w{i}", initializer=w),
                        V1.get_variable(f"b{i}", initializer=b))
                       for i, (w, b) in enumerate(_initial_values(problem))]
            flat = [v for pair in weights for v in pair]
            optimizer = V1.train.AdamOptimizer(LEARNING_RATE)
            x = tf.constant(problem.x)
            optimizer.apply_gradients([(tf.zeros_like(v), v) for v in flat])  # its slots, once

            def body(i, kept):
                loss = _forward(problem, weights, x)
                apply = optimizer.apply_gradients(zip(tf.gradients(loss, flat), flat))
                with tf.control_dependencies([apply]):
                    return i + 1, (tf.tensor_scatter_nd_update(kept, [[i]], [loss])
                                   if losses else kept)

            def loop(count, kept):
                return tf.while_loop(lambda i, _: i < count, body, [0, kept],
                                     parallel_iterations=1)

            def chunks():
                def chunk(k, out):
                    _, kept = loop(tf.minimum(CHUNK, steps - k * CHUNK), tf.zeros([CHUNK]))
                    return k + 1, tf.tensor_scatter_nd_update(out, [[k]], [kept])
                count = -(-steps // CHUNK)
                return tf.while_loop(lambda k, _: k < count, chunk,
                                     [0, tf.zeros([count, CHUNK])], parallel_iterations=1)[1]

            program = chunks if losses else lambda: loop(steps, tf.zeros([0]))[0]
            fetch = tf.function(program, jit_compile=True, autograph=False)()
            init = V1.global_variables_initializer()
        graph.finalize()
        sess = V1.Session(graph=graph)
        try:
            sess.run(init)
            yield from timing.samples(sess.make_callable(fetch), steps)
        finally:
            sess.close()
    return method


class _Skipped(Exception):
    """A method that cannot run here; its message is the table's note."""


def _jax_method(losses):
    def method(problem, steps, timing):
        yield from _jax_steps(problem, steps, timing, losses=losses)
    return method


def _jax_steps(problem, steps, timing, *, losses):
    """The same model and Adam in JAX: ``jit`` of a ``fori_loop`` of N optax steps; with
    ``losses``, each step's loss kept in an ``[N]`` array too, as ``ms.unroll`` returns."""
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except ImportError:
        raise _Skipped("skipped: pip install '.[bench]' (jax, optax)") from None
    jax.config.update("jax_platforms", "cpu")
    params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in _initial_values(problem)]
    x, y = jnp.asarray(problem.x), jnp.asarray(problem.y)
    optimizer = optax.adam(LEARNING_RATE)

    def loss(params):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    def step(i, state):
        params, opt_state, kept = state
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        if losses:
            kept = kept.at[i].set(value)
        return optax.apply_updates(params, updates), opt_state, kept

    run = jax.jit(lambda state: jax.lax.fori_loop(0, steps, step, state))
    state = [(params, optimizer.init(params), jnp.zeros(steps if losses else 0))]

    def run_steps():
        state[0] = jax.block_until_ready(run(state[0]))
    yield from timing.samples(run_steps, steps)


def _tf2_method(jit, losses=False):
    """A hand-written ``tf.range`` loop in one ``tf.function``; with ``losses``, each
    step's loss kept in an ``[N]`` TensorArray too, as ``ms.unroll`` returns them."""
    def method(problem, steps, timing):
        weights = [(tf.Variable(w), tf.Variable(b)) for w, b in _initial_values(problem)]
        flat = [v for pair in weights for v in pair]
        optimizer = V1.train.AdamOptimizer(LEARNING_RATE)
        x = tf.constant(problem.x)

        @tf.function(jit_compile=jit)
        def train():
            kept = tf.TensorArray(tf.float32, size=steps if losses else 0)
            for k in tf.range(steps):
                if losses:  # minimize's own steps, its loss kept
                    with tf.GradientTape() as tape:
                        value = _forward(problem, weights, x)
                    optimizer.apply_gradients(zip(tape.gradient(value, flat), flat))
                    kept = kept.write(k, value)
                else:
                    optimizer.minimize(lambda: _forward(problem, weights, x), var_list=flat)
            return kept.stack() if losses else tf.constant(0.0)

        yield from timing.samples(lambda: train().numpy(), steps)
    return method


def _tf2_step(problem):
    """A TF2 user's single training step on ``problem``: Keras 3 Adam over tf.Variables,
    the full batch (the step's ``batch`` argument is a dummy: one per step)."""
    import keras

    weights = [(tf.Variable(w), tf.Variable(b)) for w, b in _initial_values(problem)]
    flat = [v for pair in weights for v in pair]
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    x = tf.constant(problem.x)

    def step(batch):
        with tf.GradientTape() as tape:
            loss = _forward(problem, weights, x)
        optimizer.apply_gradients(zip(tape.gradient(loss, flat), flat))
        return loss

    return step


def _tf2_single_method(jit):
    """N calls of the single-step ``tf.function`` from Python."""
    def method(problem, steps, timing):
        single = tf.function(_tf2_step(problem), jit_compile=jit)
        batch = tf.constant(0.0)

        def run_steps():
            for _ in range(steps):
                loss = single(batch)
            loss.numpy()
        yield from timing.samples(run_steps, steps)
    return method


def _tf2_fused_method(jit):
    """``ms.tf2.fuse``: N steps in one call, every step's loss returned."""
    def method(problem, steps, timing):
        from multistep import tf2

        fused = tf2.fuse(_tf2_step(problem), steps, jit_compile=jit, check=False)
        batches = tf.zeros([steps])
        yield from timing.samples(lambda: fused(batches)["loss"].numpy(), steps)
    return method


def _keras_model(problem, steps, jit_compile):
    """The problem's model in Keras 3 with Adam, compiled for ``steps_per_execution=steps``."""
    import keras

    inputs = keras.Input((problem.x.shape[1],))
    h = inputs
    for i, ((w, _), units) in enumerate(zip(_initial_values(problem), problem.layers)):
        h = keras.layers.Dense(units, activation="relu" if i < len(problem.layers) - 1 else None,
                               kernel_initializer=keras.initializers.Constant(w))(h)
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), steps_per_execution=steps,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def _execution_clock():
    """A Keras callback that times a fit's executions: ``fit`` calls
    ``on_train_batch_end`` once per execution of N steps, so the time between two calls
    is one execution, with fit()'s fixed start-up and tear-down left out.
    ``us_per_step(steps)`` drops the first execution (tracing, iterator start)."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        def us_per_step(self, steps):
            gaps = np.diff(self.ends)[1:]
            return float(gaps.sum()) / (len(gaps) * steps) * 1e6

    return Clock()


def _keras_method(problem, steps, timing, jit_compile=False, step_history=False):
    from multistep.tf2 import keras as keras_lib

    model = _keras_model(problem, steps, jit_compile)
    data = tf.data.Dataset.from_tensors((problem.x, problem.y)).repeat()
    executions = max(3, min(problem.keras_steps, timing.keras_steps) // steps)
    clock = _execution_clock()
    # StepHistory before the clock: its per-execution read of the [N] logs is timed too.
    callbacks = ([keras_lib.StepHistory()] if step_history else []) + [clock]
    model.fit(data, steps_per_epoch=executions * steps, epochs=1, verbose=0,
              shuffle=False, callbacks=callbacks)
    while True:  # a fit a repeat
        clock.ends.clear()
        model.fit(data, steps_per_epoch=executions * steps, epochs=1, verbose=0,
                  shuffle=False, callbacks=callbacks)
        yield clock.us_per_step(steps)


METHODS = {
    "sess.run x N": _v1_method("sess.run", False),
    "make_callable x N": _v1_method("make_callable", False),
    "unrolled": _v1_method("unrolled", False),
    "unrolled+xla": _v1_method("unrolled", True),
    "while_loop": _v1_method("while_loop", False),
    "while_loop+xla": _v1_method("while_loop", True),
    "auto": _v1_method("auto", False),  # mode="auto": what it picks for the problem
    "compile unrolled": _v1_method("compile unrolled", False),
    "compile while_loop": _v1_method("compile while_loop", False),
    "compile while_loop+xla": _v1_method("compile while_loop", True),
    # The floor: a minimal TF1 XLA while loop of the same maths, keeping nothing; and the
    # same loop keeping every step's loss, the fastest way found (in chunks).
    "tf1 xla loop (floor)": _floor_method(losses=False),
    "tf1 xla loop+losses": _floor_method(losses=True),
    "tf.function": _tf2_method(False),
    "tf.function+jit": _tf2_method(True),
    "tf.function+jit+losses": _tf2_method(True, losses=True),
    "tf2 tf.function x N": _tf2_single_method(False),
    "tf2 tf.function+jit x N": _tf2_single_method(True),
    "ms.tf2.fuse": _tf2_fused_method(False),
    "ms.tf2.fuse+jit": _tf2_fused_method(True),
    "keras spe=N": _keras_method,
    "keras spe=N+jit": functools.partial(_keras_method, jit_compile=True),
    # The same fit with ms.keras.StepHistory() (every inner step's logs): what it costs.
    "keras spe=N+StepHistory": functools.partial(_keras_method, step_history=True),
    "jax fori_loop": _jax_method(losses=False),
    "jax fori_loop+losses": _jax_method(losses=True),  # like ms.unroll: the [N] losses too
}
BASELINES = ("sess.run x N", "make_callable x N", "tf2 tf.function x N")
# Unrolled XLA compiles N copies of the step; past this N the compile takes minutes.
MAX_UNROLLED_XLA_STEPS = 100


@dataclasses.dataclass(frozen=True)
class Result:
    problem: str
    steps: int
    method: str
    median_us: float
    low_us: float
    high_us: float
    note: str = ""

    @property
    def reliable(self):
        """A positive median whose spread (the interquartile range) is smaller than itself."""
        return self.median_us > 0 and self.high_us - self.low_us < self.median_us


def time_method(problem, method, steps, *, repeats=5, min_repeat_s=0.05, keras_steps=4000):
    """One (problem, method, N): per-step times in µs, median and spread."""
    return run([problem], [steps], [method], repeats=repeats, min_repeat_s=min_repeat_s,
               keras_steps=keras_steps)[0]


def _result(problem, steps, method, samples, note=""):
    if not samples:
        return Result(problem, steps, method, float("nan"), float("nan"), float("nan"), note)
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return Result(problem, steps, method, statistics.median(samples), q[0], q[2])


def graph_costs(problem, mode, steps):
    """Build time (s), node count (with function bodies) and peak memory of one run.

    ``peak_bytes``: the most bytes that the run's tensors held at once, from the
    allocation records of a fully traced run (every allocation and release, summed
    in time order; variables allocated before the run are not counted). None if
    the allocator kept no records.
    """
    with tf.Graph().as_default() as graph:
        start = time.perf_counter()
        unrolled = unroll(_graph_loss_fn(_problems()[problem]), V1.train.AdamOptimizer(LEARNING_RATE),
                          steps, global_step=V1.train.get_or_create_global_step(), mode=mode)
        build_s = time.perf_counter() - start
        graph_def = graph.as_graph_def()
        nodes = len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(unrolled.train_op)
            metadata = V1.RunMetadata()
            sess.run(unrolled.train_op, options=V1.RunOptions(trace_level=V1.RunOptions.FULL_TRACE),
                     run_metadata=metadata)
    return {"problem": problem, "mode": mode, "steps": steps, "build_s": build_s, "nodes": nodes,
            "peak_bytes": _peak_bytes(metadata.step_stats)}


def _peak_bytes(step_stats):
    records = sorted((r.alloc_micros, r.alloc_bytes) for d in step_stats.dev_stats
                     for n in d.node_stats for m in n.memory for r in m.allocation_records)
    if not records:
        return None
    live = peak = 0
    for _, change in records:
        live += change
        peak = max(peak, live)
    return peak


def run(problems, steps_list, methods, *, repeats=5, min_repeat_s=0.05, keras_steps=4000,
        progress=None):
    """Times every (problem, N, method): the methods of one (problem, N) are built and
    warmed up in turn, then take turns for their repeats, the order rotated each round.
    ``progress(done, total)`` is called as each method is built (the slow part)."""
    timing = _Timing(min_repeat_s, keras_steps)
    results, done, total = [], 0, len(problems) * len(steps_list) * len(methods)
    for p in problems:
        for n in steps_list:
            samples, notes, running = {m: [] for m in methods}, {}, {}
            try:
                for m in methods:
                    if m == "unrolled+xla" and n > MAX_UNROLLED_XLA_STEPS:
                        notes[m] = f"skipped: N > {MAX_UNROLLED_XLA_STEPS} (compile time)"
                    else:
                        running[m] = METHODS[m](_problems()[p], n, timing)
                        try:
                            samples[m].append(next(running[m]))  # built, warmed up, 1 repeat
                        except _Skipped as skipped:
                            notes[m] = str(skipped)
                            del running[m]
                    done += 1
                    if progress:
                        progress(done, total)
                order = list(running)
                for r in range(1, repeats if order else 1):
                    for m in order[r % len(order):] + order[:r % len(order)]:
                        samples[m].append(next(running[m]))
            finally:
                for generator in running.values():
                    generator.close()  # its session, at once
            results += [_result(p, n, m, samples[m], notes.get(m, "")) for m in methods]
    return results


def table(results):
    """The results as text: µs per step, spread, and speed-ups over N x sess.run and over
    N x make_callable (TF1's fastest single steps), where both were measured.

    A figure whose spread is as large as itself is marked unreliable and given
    no ratio; nor is a ratio against an unreliable baseline.
    """
    bases = {name: {(r.problem, r.steps): r for r in results if r.method == name}
             for name in BASELINES}
    lines = [f"{'problem':<7} {'N':>5}  {'method':<24} {'µs/step':>9} {'spread (IQR)':>17} "
             + " ".join(f"{'vs ' + name:>21}" for name in BASELINES)]
    for r in results:
        if np.isnan(r.median_us):
            lines.append(f"{r.problem:<7} {r.steps:>5}  {r.method:<24} {'—':>9} {'':>17} {r.note}")
            continue
        ratios = [_ratio(r, base.get((r.problem, r.steps))) for base in bases.values()]
        lines.append(f"{r.problem:<7} {r.steps:>5}  {r.method:<24} {r.median_us:>9.2f} "
                     f"{f'{r.low_us:.2f}-{r.high_us:.2f}':>17} " + " ".join(f"{x:>21}" for x in ratios))
    return "\n".join(lines)


def _ratio(result, reference):
    if not result.reliable:
        return "unreliable (spread)"
    if reference is None:
        return "—"
    if not reference.reliable:
        return "— (base unreliable)"
    return f"{reference.median_us / result.median_us:.2f}x"


def graph_table(costs):
    """Build time, node count and peak memory against N, with ratios to the smallest N."""
    first = {}
    lines = [f"{'problem':<7} {'mode':<10} {'N':>5} {'build s':>8} {'nodes':>7} "
             f"{'peak KiB':>9} {'peak / first N':>14}"]
    for c in costs:
        base = first.setdefault((c["problem"], c["mode"]), c)
        peak = "—" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 2**10:.1f}"
        ratio = (f"{c['peak_bytes'] / base['peak_bytes']:.2f}x"
                 if c["peak_bytes"] and base["peak_bytes"] else "—")
        lines.append(f"{c['problem']:<7} {c['mode']:<10} {c['steps']:>5} {c['build_s']:>8.2f} "
                     f"{c['nodes']:>7} {peak:>9} {ratio:>14}")
    return "\n".join(lines)


def write_csv(rows, path):
    """Writes ``Result``s or ``graph_costs`` dicts as CSV."""
    rows = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot(results, path):
    """A PNG of µs/step against N per method and problem, the median of the repeats with
    their spread (the interquartile range) as bars; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = sorted({r.problem for r in results})
    fig, axes = plt.subplots(1, len(problems), figsize=(6 * len(problems), 4.5), squeeze=False)
    for ax, problem in zip(axes[0], problems):
        for method in METHODS:
            points = [r for r in results
                      if r.problem == problem and r.method == method and not np.isnan(r.median_us)]
            if points:
                ax.errorbar([r.steps for r in points], [r.median_us for r in points],
                            yerr=[[r.median_us - r.low_us for r in points],
                                  [r.high_us - r.median_us for r in points]],
                            marker="o", capsize=3, label=method)
        ax.set(xscale="log", yscale="log", xlabel="N (steps per call)", ylabel="µs per step",
               title=problem)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
