"""N fused steps on two worker processes: MultiWorkerMirroredStrategy on 127.0.0.1.

This script starts its two workers itself (``multistep.loops.cluster``: free ports, a
``TF_CONFIG`` each, every process bounded in time and stopped at the end). Each
worker runs a ``tf.distribute.Server`` with the strategy's ``update_config_proto``
and a session on it, and builds, in the same order on both, N fused steps
(``ms.distribute.unroll``) beside the hand-written single distributed step; every
inner step all-reduces the gradients across the workers. It prints each worker's
max |Δ| between the fused weights and the single steps', and between the workers.

    python examples/two_workers.py

On several machines each worker is started by hand instead: set ``TF_CONFIG``
(``{"cluster": {"worker": [host:port, ...]}, "task": {"type": "worker", "index": i}}``)
and run ``python examples/two_workers.py --worker OUT_DIR`` on every machine (the
``worker`` function: the same graph, built in the same order, on each).
"""

import json
import os
import sys
import tempfile

import numpy as np

STEPS, RUNS, GLOBAL_BATCH = 5, 4, 16


def worker(out_dir):
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    tf.get_logger().setLevel("ERROR")  # TF1 deprecation notices of the v1 distribute API
    import multistep as ms

    v1 = tf.compat.v1
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = v1.distribute.experimental.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    ms.distribute.set_collective_timeout(strategy, 30)  # a lost peer fails a run, not hangs it
    config = strategy.update_config_proto(v1.ConfigProto())
    server = tf.distribute.Server(strategy.cluster_resolver.cluster_spec(), job_name="worker",
                                  task_index=index, config=config)
    rng = np.random.RandomState(0)
    x = rng.randn(GLOBAL_BATCH * STEPS * RUNS, 4).astype(np.float32)
    y = (x @ rng.randn(4, 2)).astype(np.float32)

    def model(scope):
        with strategy.scope(), v1.variable_scope(scope):
            w = v1.get_variable("w", initializer=np.zeros((4, 2), np.float32))
        return w, lambda xb, yb: tf.reduce_sum(tf.square(xb @ w - yb)) / GLOBAL_BATCH

    def batches():  # each worker takes its half of every global batch
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        return strategy.make_dataset_iterator(data)

    # The same graph on both workers, built in the same order: collective keys are
    # allocated as the ops are built.
    w_fused, loss_fused = model("fused")
    fused_inputs = batches()
    fused = ms.distribute.unroll(strategy, loss_fused, v1.train.AdamOptimizer(0.1), STEPS,
                                 inputs=fused_inputs)
    w_single, loss_single = model("single")
    single_inputs = batches()
    opt = v1.train.AdamOptimizer(0.1)

    def single_step(batch):  # the hand-written single distributed step
        loss = loss_single(*batch)
        return opt.apply_gradients(opt.compute_gradients(loss, var_list=[w_single]))

    with strategy.scope():
        single = strategy.extended.call_for_each_replica(single_step, args=(single_inputs.get_next(),))
        single = tf.group(strategy.experimental_local_results(single))
    with v1.Session(server.target, config=config) as sess:
        sess.run([v1.global_variables_initializer(), fused_inputs.initializer,
                  single_inputs.initializer])
        losses = []
        with ms.distribute.catch_lost_worker(strategy):
            for _ in range(RUNS):
                losses.extend(fused.run(sess))
                for _ in range(STEPS):
                    sess.run(single)
        fused_w, single_w = sess.run([w_fused, w_single])
    np.savez(os.path.join(out_dir, f"worker{index}.npz"), fused=fused_w, single=single_w,
             losses=np.array(losses))


def main():
    from multistep.loops.cluster import run_workers

    with tempfile.TemporaryDirectory() as out_dir:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in [root, os.environ.get("PYTHONPATH")] if p))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        done = run_workers([sys.executable, os.path.abspath(__file__), "--worker", out_dir], 2,
                           timeout=300, env=env)
        for i, (rc, _, err) in enumerate(done):
            if rc != 0:
                sys.exit(f"worker {i} failed (exit {rc}):\n{err[-3000:]}")
        got = [dict(np.load(os.path.join(out_dir, f"worker{i}.npz"))) for i in range(2)]
    print(f"2 workers on 127.0.0.1, {RUNS} runs of {STEPS} fused steps beside {RUNS * STEPS} "
          f"single distributed steps (Adam, gradients all-reduced across the workers every step)")
    print("losses (mean over the workers), fused:", np.round(got[0]["losses"][::STEPS], 5), "...")
    for i, g in enumerate(got):
        diff = float(np.max(np.abs(g["fused"] - g["single"])))
        same = g["fused"].tobytes() == g["single"].tobytes()
        print(f"worker {i}: fused vs single steps: max |Δ| = {diff:g}"
              + (" (bitwise equal)" if same else " (DIFFER)"))
    diff = float(np.max(np.abs(got[0]["fused"] - got[1]["fused"])))
    same = got[0]["fused"].tobytes() == got[1]["fused"].tobytes()
    print(f"workers 0 and 1: max |Δ| = {diff:g}" + (" (bitwise equal)" if same else " (DIFFER)"))
    all_same = same and all(g["fused"].tobytes() == g["single"].tobytes() for g in got)
    return 0 if all_same else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        sys.exit(main())
