"""Bench rows under distribution: N x ``sess.run`` of the single distributed step against
one fused run of N steps, under ``MirroredStrategy`` (two logical CPUs, one process) and
under ``MultiWorkerMirroredStrategy`` (two worker processes on 127.0.0.1).

The problem is the blobs classifier (dense 2->2 softmax on ``make_blobs``' 50 points,
full batch), each replica its share of the points, Adam(0.01). The single step is the
hand-written one (``call_for_each_replica`` of ``compute_gradients`` +
``apply_gradients``); the fused run is ``ms.distribute.unroll(...).train_op``.

Both settings run in subprocesses: logical devices must be set before a process's
first session, and the workers are processes of their own. A repeat makes a fixed
number of calls (``min_steps`` steps, at least one call), the same on every worker: a
worker's collectives must be matched by the other's, so no worker may decide alone
how often to run. Rows are ``multistep.tools.bench.Result``; ``table`` prints them with each
fused row's speed-up over the N x ``sess.run`` row of its setting.

    python -m multistep.tools.bench_distributed [--quick] [--steps 1 10 100] [--repeats 5]
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

__all__ = ["MAX_STEPS", "SETTINGS", "distributed_rows", "table"]

# Unrolled under a strategy builds N merge_calls; past this N the build takes minutes.
MAX_STEPS = 100
SETTINGS = {"mirrored": "2 replicas", "workers": "2 workers"}
METHODS = ("sess.run x N", "unrolled")
LEARNING_RATE = 0.01
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def distributed_rows(ns=(1, 10, 100), repeats=5, quick=False, *, min_steps=None, timeout=900):
    """Times N x sess.run and fused N-step runs under both settings, side by side.

    Returns ``multistep.tools.bench.Result`` rows, problem ``"blobs"``, methods
    ``"2 replicas: sess.run x N"``, ``"2 replicas: unrolled"``, ``"2 workers: ..."``;
    N above ``MAX_STEPS`` gives rows with a note instead of times. ``quick``: N in
    {1, 10} (of ``ns``), at most 3 repeats, fewer steps a repeat.
    """
    from multistep.tools.bench import Result

    ns = [int(n) for n in ns]
    if quick:
        ns = [n for n in ns if n <= 10] or [1, 10]
        repeats = min(repeats, 3)
    min_steps = min_steps or (30 if quick else 300)
    timed = [n for n in ns if n <= MAX_STEPS]
    samples = {}
    if timed:
        args = ["--ns", *map(str, timed), "--repeats", str(repeats), "--min-steps", str(min_steps)]
        samples.update(_mirrored(args, timeout))
        samples.update(_workers(args, timeout))
    rows = []
    for setting, label in SETTINGS.items():
        for n in ns:
            for method in METHODS:
                name = f"{label}: {method}"
                if n > MAX_STEPS:
                    rows.append(Result("blobs", n, name, math.nan, math.nan, math.nan,
                                       f"skipped: N > {MAX_STEPS} (build time under a strategy)"))
                    continue
                s = samples[f"{setting}/{n}/{method}"]
                q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
                rows.append(Result("blobs", n, name, statistics.median(s), q[0], q[2]))
    return rows


def table(rows):
    """The rows as text: µs per step, spread (IQR), and each fused row's speed-up over
    the N x sess.run row of the same setting and N (none where either is unreliable)."""
    base = {(r.method.split(":")[0], r.steps): r for r in rows if r.method.endswith("sess.run x N")}
    lines = [(f"{'problem':<7} {'N':>5}  {'method':<26} {'µs/step':>9} {'spread (IQR)':>17} "
              f"{'vs its sess.run x N':>20}")]
    for r in rows:
        if math.isnan(r.median_us):
            lines.append(f"{r.problem:<7} {r.steps:>5}  {r.method:<26} {'—':>9} {'':>17} {r.note}")
            continue
        ref = base.get((r.method.split(":")[0], r.steps))
        if r.method.endswith("sess.run x N"):
            ratio = ""
        elif not r.reliable or ref is None or not ref.reliable:
            ratio = "unreliable (spread)"
        else:
            ratio = f"{ref.median_us / r.median_us:.2f}x"
        lines.append(f"{r.problem:<7} {r.steps:>5}  {r.method:<26} {r.median_us:>9.2f} "
                     f"{f'{r.low_us:.2f}-{r.high_us:.2f}':>17} {ratio:>20}")
    return "\n".join(lines)


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _parse(stdout, what):
    for line in stdout.splitlines():
        if line.startswith("SAMPLES "):
            return json.loads(line[len("SAMPLES "):])
    raise RuntimeError(f"{what} printed no samples")


def _mirrored(args, timeout):
    done = subprocess.run([sys.executable, "-m", "multistep.tools.bench_distributed", "--part", "mirrored",
                           *args], env=_env(), cwd=_ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the MirroredStrategy bench failed:\n{done.stderr[-3000:]}")
    return _parse(done.stdout, "the MirroredStrategy bench")


def _workers(args, timeout):
    from multistep.loops.cluster import run_workers

    done = run_workers([sys.executable, "-m", "multistep.tools.bench_distributed", "--part", "worker",
                        *args], 2, timeout=timeout, env=_env(), cwd=_ROOT)
    for i, (rc, _, err) in enumerate(done):
        if rc != 0:
            raise RuntimeError(f"bench worker {i} failed (exit {rc}):\n{err[-3000:]}")
    return _parse(done[0][1], "bench worker 0")  # both timed the same runs; the chief's


# --- in the subprocesses -------------------------------------------------------------

def _programs(strategy, ns):
    """For each N: (the single step's op, the fused run's op), each on its own variables.
    Built in one fixed order (the same on every worker: collective keys follow it)."""
    import numpy as np
    import tensorflow as tf

    from multistep.tools import blobs
    from multistep.loops import distribute

    v1 = tf.compat.v1
    x, y = blobs.data(0)
    replicas = strategy.num_replicas_in_sync
    bounds = np.linspace(0, len(x), replicas + 1).astype(int)
    starts, sizes = tf.constant(bounds[:-1]), tf.constant(np.diff(bounds))

    def model(scope):
        with strategy.scope(), v1.variable_scope(scope):
            kernel = v1.get_variable("kernel", [2, 2], initializer=v1.ones_initializer())
            bias = v1.get_variable("bias", [2], initializer=v1.zeros_initializer())

        def loss_fn():  # this replica's points; sum / 50: the all-reduce sums the replicas'
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            mine = tf.range(starts[r], starts[r] + sizes[r])
            logits = tf.matmul(tf.gather(x, mine), kernel) + bias
            return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.gather(y, mine), logits=logits)) / len(x)
        return loss_fn, [kernel, bias]

    programs = {}
    for n in ns:
        loss_fn, var_list = model(f"single_{n}")
        opt = v1.train.AdamOptimizer(LEARNING_RATE)

        def step(loss_fn=loss_fn, var_list=var_list, opt=opt):
            return opt.apply_gradients(opt.compute_gradients(loss_fn(), var_list=var_list))

        with strategy.scope():
            single = tf.group(strategy.experimental_local_results(
                strategy.extended.call_for_each_replica(step)))
        loss_fn, _ = model(f"fused_{n}")
        fused = distribute.unroll(strategy, loss_fn, v1.train.AdamOptimizer(LEARNING_RATE), n).train_op
        programs[n] = (single, fused)
    return programs


def _samples(sess, programs, repeats, min_steps):
    """µs per step, ``repeats`` samples each; a repeat makes a fixed number of calls."""
    out = {}
    for n, (single, fused) in programs.items():
        for method, op, steps_per_call in (("sess.run x N", single, 1), ("unrolled", fused, n)):
            calls = max(1, -(-min_steps // steps_per_call))
            sess.run(op)  # warm-up
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    sess.run(op)
                samples.append((time.perf_counter() - start) / (calls * steps_per_call) * 1e6)
            out[method, n] = samples
    return out


def _run_part(part, ns, repeats, min_steps):
    import tensorflow as tf

    if part == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]  # before the first session
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.compat.v1.disable_eager_execution()
    tf.get_logger().setLevel("ERROR")
    from multistep.loops import distribute

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        if part == "mirrored":
            strategy = v1.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
            config, target = None, ""
        else:
            strategy = v1.distribute.experimental.MultiWorkerMirroredStrategy()  # TF_CONFIG
            # No collective timeout: TensorFlow starts a thread per timed collective, and
            # thousands of fused steps a second run out of threads; run_workers bounds us.
            config = strategy.update_config_proto(v1.ConfigProto())
            resolver = strategy.cluster_resolver
            server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                          task_index=resolver.task_id, config=config)
            target = server.target
        programs = _programs(strategy, ns)
        init = v1.global_variables_initializer()
    with v1.Session(target, graph=graph, config=config) as sess:
        sess.run(init)
        with distribute.catch_lost_worker(strategy):
            got = _samples(sess, programs, repeats, min_steps)
    setting = "mirrored" if part == "mirrored" else "workers"
    print("SAMPLES " + json.dumps({f"{setting}/{n}/{m}": s for (m, n), s in got.items()}), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m multistep.tools.bench_distributed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", nargs="+", type=int, default=[1, 10, 100])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", choices=["mirrored", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--ns", nargs="+", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--min-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        _run_part(args.part, args.ns, args.repeats, args.min_steps)
        return 0
    print(table(distributed_rows(args.steps, args.repeats, args.quick, min_steps=args.min_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
