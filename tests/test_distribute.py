"""ms.unroll under tf.compat.v1.distribute.MirroredStrategy over two logical CPUs, against
the canonical hand-written single distributed step (call_for_each_replica of
compute_gradients + apply_gradients, one sess.run per step), bitwise on every variable's
copy on every replica and on the global step.

Logical devices must be configured before a process's first session, and this pytest
process has made sessions in other tests, so the distributed cases run in one
subprocess (bounded by a timeout) that prints their results as JSON."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

# one xdist worker runs this file: its module-scoped fixtures are built once
pytestmark = pytest.mark.xdist_group("test_distribute")

V1 = tf.compat.v1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import json
import os
import sys

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.compat.v1.disable_eager_execution()
tf.get_logger().setLevel("ERROR")
import multistep as ms  # noqa: E402

V1 = tf.compat.v1
DEVICES = ["/cpu:0", "/cpu:1"]
GLOBAL_BATCH, RUNS = 8, 2
rng = np.random.RandomState(0)
X = rng.randn(3 * RUNS * GLOBAL_BATCH, 3).astype(np.float32)
Y = rng.randn(3 * RUNS * GLOBAL_BATCH, 2).astype(np.float32)
W0 = rng.randn(3, 2).astype(np.float32)
LR = 0.1
results = {}


def model():
    """Weights (mirrored: created under the strategy's scope), and the loss of one
    replica's batch scaled by the global batch, so the replicas' summed gradients are
    the full batch's gradient."""
    w = V1.get_variable("w", initializer=W0, use_resource=True)
    b = V1.get_variable("b", initializer=np.zeros(2, np.float32), use_resource=True)
    moving = V1.get_variable("moving", initializer=np.zeros(3, np.float32), trainable=False,
                             use_resource=True, synchronization=tf.VariableSynchronization.ON_READ,
                             aggregation=tf.VariableAggregation.MEAN)
    gs = V1.train.get_or_create_global_step()

    def loss_fn(x, y, update=False):
        if update:  # batch-norm style: moving statistics, through UPDATE_OPS
            V1.add_to_collection(V1.GraphKeys.UPDATE_OPS, moving.assign(
                0.9 * moving + 0.1 * tf.reduce_mean(x, 0), read_value=False))
        return tf.reduce_sum(tf.square(tf.matmul(x, w) + b - y)) / GLOBAL_BATCH

    return loss_fn, gs


def optimizer(name):
    return {"sgd": lambda: V1.train.GradientDescentOptimizer(LR),
            "adam": lambda: V1.train.AdamOptimizer(LR)}[name]()


def dataset():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)


def state(sess, strategy):
    """Every component of every global variable, on every replica, by name."""
    out = {}
    for v in V1.global_variables():
        for i, local in enumerate(strategy.experimental_local_results(v)):
            out[f"{v.name}@{i}"] = sess.run(local)
    return out


def build(opt_name, steps, fused, update=False, clip=None, mode="unrolled"):
    """Returns (graph, run(sess) -> losses, strategy) for a fused N-step program or the
    canonical single distributed step."""
    graph = tf.Graph()
    with graph.as_default():
        strategy = V1.distribute.MirroredStrategy(DEVICES)
        with strategy.scope():
            loss_fn, gs = model()
        opt = optimizer(opt_name)
        iterator = strategy.make_dataset_iterator(dataset())
        if fused:
            transforms = [ms.clip_by_global_norm(clip)] if clip else []
            u = ms.distribute.unroll(strategy, lambda x, y: loss_fn(x, y, update), opt, steps,
                                     inputs=iterator, global_step=gs, grad_transforms=transforms,
                                     record=("grad_norm",), mode=mode)
            fetch = u.losses
        else:
            def step(batch):  # the canonical single distributed step
                x, y = batch
                updates = V1.get_collection_ref(V1.GraphKeys.UPDATE_OPS)
                before = len(updates)
                loss = loss_fn(x, y, update)
                with tf.control_dependencies(updates[before:]):  # this replica's
                    grads_and_vars = opt.compute_gradients(loss)
                if clip:
                    grads, _ = tf.clip_by_global_norm([g for g, _ in grads_and_vars], clip)
                    grads_and_vars = list(zip(grads, [v for _, v in grads_and_vars]))
                with tf.control_dependencies([opt.apply_gradients(grads_and_vars, global_step=gs)]):
                    return tf.identity(loss)

            with strategy.scope():
                per_replica = strategy.extended.call_for_each_replica(step, args=(iterator.get_next(),))
                fetch = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)[None]
        init = [V1.global_variables_initializer(), iterator.initializer]
    sess = V1.Session(graph=graph)
    sess.run(init)

    def run():
        return sess.run(fetch)
    return graph, sess, run, strategy


def compare(opt_name, steps, update=False, clip=None, mode="unrolled"):
    fg, fs, frun, fstrat = build(opt_name, steps, True, update, clip, mode)
    sg, ss, srun, sstrat = build(opt_name, steps, False, update, clip)
    out = {"bitwise": True, "runs": []}
    for r in range(RUNS):
        got = frun()
        want = np.concatenate([srun() for _ in range(steps)])
        with fg.as_default():
            a = state(fs, fstrat)
        with sg.as_default():
            b = state(ss, sstrat)
        same = sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
        same = same and got.tobytes() == want.tobytes()
        out["runs"].append({"same": bool(same), "names": sorted(a),
                            "max_diff": max(float(np.max(np.abs(a[n].astype(np.float64) - b[n])))
                                            for n in a if n in b),
                            "replicas_differ": {n: bool(a[n].tobytes() != a[n[:-1] + "0"].tobytes())
                                                for n in a}})
        out["bitwise"] = out["bitwise"] and same
    fs.close()
    ss.close()
    return out




def user_replica_fn_with_after_apply(steps):
    """ms.unroll called by the user's own call_for_each_replica function, with an
    after_apply (a max-norm projection of w); against the same hand-written step."""
    out = {}
    for fused in (True, False):
        graph = tf.Graph()
        with graph.as_default():
            strategy = V1.distribute.MirroredStrategy(DEVICES)
            with strategy.scope():
                w = V1.get_variable("w", initializer=W0, use_resource=True,
                                    aggregation=tf.VariableAggregation.MEAN)
                gs = V1.train.get_or_create_global_step()
            opt = V1.train.AdamOptimizer(LR)
            xs = tf.constant(X[:2 * steps * 4].reshape(2, steps, 4, 3))
            project = lambda: w.assign(tf.clip_by_norm(w, 1.0), read_value=False)

            def loss_fn(x):
                return tf.reduce_sum(tf.square(tf.matmul(x, w))) / GLOBAL_BATCH

            def replica(k=None):
                r = tf.distribute.get_replica_context().replica_id_in_sync_group
                mine = tf.gather(xs, r)
                if fused:
                    return ms.unroll(loss_fn, opt, steps, inputs=mine, global_step=gs,
                                     after_apply=project).train_op
                train = opt.apply_gradients(opt.compute_gradients(loss_fn(mine[k])), global_step=gs)
                with tf.control_dependencies([train]):
                    return project()

            with strategy.scope():
                if fused:
                    ops = [strategy.extended.call_for_each_replica(replica)]
                else:
                    ops = [strategy.extended.call_for_each_replica(replica, args=(k,))
                           for k in range(steps)]
                ops = [tf.group(strategy.experimental_local_results(op)) for op in ops]
            init = V1.global_variables_initializer()
        with V1.Session(graph=graph) as sess:
            sess.run(init)
            for op in ops:
                sess.run(op)
            with graph.as_default():
                out[fused] = state(sess, strategy)
    a, b = out[True], out[False]
    return {"bitwise": sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a),
            "names": sorted(a), "norm": float(np.linalg.norm(a["w:0@0"]))}


def refused(**options):
    with tf.Graph().as_default():
        strategy = V1.distribute.MirroredStrategy(DEVICES)
        with strategy.scope():
            loss_fn, gs = model()
        try:
            ms.distribute.unroll(strategy, loss_fn, V1.train.GradientDescentOptimizer(LR), 3,
                                 inputs=(tf.constant(X[:12].reshape(3, 4, 3)),
                                         tf.constant(Y[:12].reshape(3, 4, 2))), **options)
        except Exception as error:  # noqa: BLE001 (the type is asserted by the test)
            return {"type": type(error).__name__, "message": str(error)}
    return {"type": None}


def verify_build(steps):
    strategy = V1.distribute.MirroredStrategy(DEVICES)  # created in the fresh graph
    with strategy.scope():
        loss_fn, gs = model()
    iterator = strategy.make_dataset_iterator(dataset())
    u = ms.distribute.unroll(strategy, loss_fn, V1.train.AdamOptimizer(LR), steps,
                             inputs=iterator, global_step=gs)
    return u, {}


def grad_norms(steps, runs=2):
    """record=("grad_norm",) against the norm of the gradient a hand-written single
    distributed step applies: the replicas' gradients summed (as the optimizer's
    all-reduce sums them), in the cross-replica context. Two terms add up the same in
    either order, so the two are meant to be bitwise equal."""
    out = {}
    for fused in (True, False):
        graph = tf.Graph()
        with graph.as_default():
            strategy = V1.distribute.MirroredStrategy(DEVICES)
            with strategy.scope():
                loss_fn, gs = model()
            opt = optimizer("sgd")
            iterator = strategy.make_dataset_iterator(dataset())
            if fused:
                u = ms.distribute.unroll(strategy, loss_fn, opt, steps, inputs=iterator,
                                         global_step=gs, record=("grad_norm",))
                fetch = u.records["grad_norm"]
            else:
                def step(batch):
                    grads_and_vars = opt.compute_gradients(loss_fn(*batch))
                    with tf.control_dependencies([opt.apply_gradients(grads_and_vars, global_step=gs)]):
                        return [tf.identity(g) for g, _ in grads_and_vars]

                with strategy.scope():
                    local = strategy.extended.call_for_each_replica(step, args=(iterator.get_next(),))
                    summed = [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None) for g in local]
                    fetch = tf.linalg.global_norm(summed)[None]
                    mean_of_norms = strategy.reduce(
                        tf.distribute.ReduceOp.MEAN, strategy.extended.call_for_each_replica(
                            lambda *g: tf.linalg.global_norm(list(g)), args=tuple(local)), axis=None)
            init = [V1.global_variables_initializer(), iterator.initializer]
        with V1.Session(graph=graph) as sess:
            sess.run(init)
            if fused:
                out[fused] = np.concatenate([sess.run(fetch) for _ in range(runs)]).tolist()
            else:
                pairs = [sess.run([fetch, mean_of_norms]) for _ in range(runs * steps)]
                out[fused] = np.concatenate([p[0] for p in pairs]).tolist()
                out["mean_of_replica_norms"] = [float(p[1]) for p in pairs]
    return {"fused": out[True], "applied": out[False],
            "mean_of_replica_norms": out["mean_of_replica_norms"]}


def remainder(steps=2, batches=5):
    """A dataset of 5 batches, 2 steps a run: two runs train 4 steps; the third finds one
    batch where it needs two: it must apply nothing and say so (its batches are taken
    before its first step), with the true global step."""
    with tf.Graph().as_default():
        strategy = V1.distribute.MirroredStrategy(DEVICES)
        with strategy.scope():
            loss_fn, gs = model()
        data = tf.data.Dataset.from_tensor_slices((X[:batches * GLOBAL_BATCH],
                                                   Y[:batches * GLOBAL_BATCH])).batch(GLOBAL_BATCH)
        iterator = strategy.make_dataset_iterator(data)
        u = ms.distribute.unroll(strategy, loss_fn, optimizer("sgd"), steps, inputs=iterator,
                                 global_step=gs)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), iterator.initializer])
            runs = 0
            try:
                while True:
                    u.run(sess)
                    runs += 1
            except ms.InputExhaustedError as error:
                return {"runs": runs, "global_step": int(sess.run(gs)), "message": str(error)}
    return {"runs": runs}


def half_and_full():
    """The same 6 SGD steps (2 runs of 3): 2 replicas x 4 rows, and 1 device x 8 rows."""
    out = {}
    for replicas in (2, 1):
        graph = tf.Graph()
        with graph.as_default():
            if replicas == 2:
                strategy = V1.distribute.MirroredStrategy(DEVICES)
                with strategy.scope():
                    loss_fn, gs = model()
                iterator = strategy.make_dataset_iterator(dataset())
                u = ms.distribute.unroll(strategy, loss_fn, optimizer("sgd"), 3, inputs=iterator,
                                         global_step=gs)
                init = [V1.global_variables_initializer(), iterator.initializer]
            else:
                loss_fn, gs = model()
                u = ms.unroll(loss_fn, optimizer("sgd"), 3, inputs=V1.data.make_one_shot_iterator(
                    dataset()), global_step=gs)
                init = [V1.global_variables_initializer()]
            variables = {v.name: v for v in V1.global_variables()}
        with V1.Session(graph=graph) as sess:
            sess.run(init)
            for _ in range(RUNS):
                u.run(sess)
            out[replicas] = {n: sess.run(variables[n]).tolist() for n in ("w:0", "b:0")}
    return out


results = {}
for opt_name in ("sgd", "adam"):
    for steps in (1, 3):
        results[f"{opt_name}_{steps}"] = compare(opt_name, steps)
results["adam_3_clip"] = compare("adam", 3, clip=0.5)
results["sgd_3_update_ops"] = compare("sgd", 3, update=True)
results["adam_3_clip_loop"] = compare("adam", 3, clip=0.5, mode="while_loop")
results["sgd_3_update_ops_loop"] = compare("sgd", 3, update=True, mode="while_loop")
results["user_replica_fn"] = user_replica_fn_with_after_apply(3)
results["refused_xla"] = refused(xla=True)
results["refused_skip"] = refused(nonfinite="skip")
results["half_and_full"] = half_and_full()
results["grad_norms"] = grad_norms(3)
results["remainder"] = remainder()
report = ms.verify(verify_build, steps=3, runs=2)
results["verify"] = {"ok": report.ok, "bitwise": report.bitwise, "summary": report.summary()}
print("RESULTS " + json.dumps(results))
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("distribute") / "cases.py"
    path.write_text(SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.mark.parametrize("case", ["sgd_1", "sgd_3", "adam_1", "adam_3", "adam_3_clip",
                                  "sgd_3_update_ops", "adam_3_clip_loop", "sgd_3_update_ops_loop"])
def test_fused_equals_single_distributed_steps_bitwise(results, case):
    """Per-replica inputs from strategy.make_dataset_iterator, 2 runs; every copy of every
    variable (weights, Adam's slots and beta powers, the moving statistic, the global
    step) and the reduced losses, bit for bit, after each run; unrolled and, where the
    case ends in _loop, in loop mode (the replicas' steps compiled as one loop body)."""
    got = results[case]
    assert [r["same"] for r in got["runs"]] == [True, True], got["runs"]
    names = got["runs"][0]["names"]
    assert "global_step:0@1" in names and "w:0@1" in names
    if case.startswith("adam"):  # a single step's names, not under multistep/step_1
        assert "beta1_power:0@0" in names and "w/Adam:0@1" in names


def test_verify_builds_under_a_strategy(results):
    """ms.verify on a build_fn that creates its MirroredStrategy and distributed iterator."""
    assert results["verify"]["ok"] and results["verify"]["bitwise"], results["verify"]["summary"]


def test_update_ops_run_per_replica(results):
    """The moving statistic is per replica (ON_READ): each replica's copy moved with its own
    rows, and both matched the single steps bitwise (above)."""
    assert results["sgd_3_update_ops"]["runs"][-1]["replicas_differ"]["moving:0@1"]
    assert not results["sgd_3_update_ops"]["runs"][-1]["replicas_differ"]["w:0@1"]


def test_ms_unroll_in_the_users_replica_function_with_after_apply(results):
    """ms.unroll inside the user's own call_for_each_replica function, an after_apply
    projection on a MEAN-aggregated weight, Adam: bitwise the hand-written steps."""
    assert results["user_replica_fn"]["bitwise"], results["user_replica_fn"]
    assert results["user_replica_fn"]["norm"] <= 1.0


@pytest.mark.parametrize("case,option", [("refused_xla", "xla=True"),
                                         ("refused_skip", "nonfinite='skip'")])
def test_control_flow_modes_refused_under_a_strategy(results, case, option):
    got = results[case]
    assert got["type"] == "ValueError", got
    assert option in got["message"] and "merge_call" in got["message"]
    assert "mode='unrolled'" in got["message"]


def test_two_replicas_of_half_a_batch_equal_one_device_of_the_whole_batch(results):
    """Six SGD steps, 2 replicas x 4 rows against 1 device x 8 rows.

    Both programs compute, per step, the gradient g = c * sum_i x_i (x_i w + b - y_i)
    with c = 2/8 (the loss is sum/8 on both: the replicas' summed gradients are the full
    batch's), in float32, in other orders: the replicas sum 4 rows each and the
    all-reduce adds the two partial sums. Rounding bound (u = 2**-24, gamma_m = m u /
    (1 - m u)): a residual r_i costs 3 (dot of 3) + 2 (bias, y) roundings relative to
    R_i = sum_j |x_ij w_j| + |b| + |y_i|; the product with x_ij one more; a sum of 8
    terms, however grouped, at most 7: so each program is within gamma_13 * T of the
    exact gradient, T = c sum_i |x_i| R_i (|x| = 1 for the bias), and the two differ by
    at most 2 gamma_13 T per entry. The update w - lr g rounds once in each program:
    2 u |w| more. An error e in the weights propagates through the next step as
    (I - lr H) e, H = c X^T X (with the bias column), a contraction in the 2-norm when
    lr * lambda_max(H) <= 2, checked below; so after K steps the 2-norm of the
    difference is at most sum_k (lr * 2 gamma_13 ||T_k|| + 2 u ||theta_k||), computed
    here in float64 along the float64 trajectory."""
    got = results["half_and_full"]
    two = np.concatenate([np.ravel(got["2"]["w:0"]), got["2"]["b:0"]])
    one = np.concatenate([np.ravel(got["1"]["w:0"]), got["1"]["b:0"]])
    rng = np.random.RandomState(0)  # the script's data
    x_all = rng.randn(48, 3).astype(np.float32).astype(np.float64)
    y_all = rng.randn(48, 2).astype(np.float32).astype(np.float64)
    w = rng.randn(3, 2).astype(np.float32).astype(np.float64)
    b = np.zeros(2)
    lr, c, u = 0.1, 2 / 8, 2.0 ** -24
    gamma = 13 * u / (1 - 13 * u)
    bound = 0.0
    for k in range(6):
        x, y = x_all[8 * k:8 * k + 8], y_all[8 * k:8 * k + 8]
        ones = np.hstack([x, np.ones((8, 1))])
        assert lr * np.linalg.eigvalsh(c * ones.T @ ones).max() <= 2
        magnitude = np.abs(x) @ np.abs(w) + np.abs(b) + np.abs(y)  # R, [8, 2]
        t = np.concatenate([np.ravel(c * np.abs(x).T @ magnitude), c * magnitude.sum(0)])
        r = x @ w + b - y
        w, b = w - lr * c * x.T @ r, b - lr * c * r.sum(0)
        bound += lr * 2 * gamma * np.linalg.norm(t) + 2 * u * np.linalg.norm(
            np.concatenate([np.ravel(w), b]))
    assert np.abs(two - np.concatenate([np.ravel(w), b])).max() < 1e-5  # the steps were taken
    assert np.linalg.norm(two - one) <= bound, (np.linalg.norm(two - one), bound)


def test_sync_replicas_optimizer_refused():
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        opt = V1.train.SyncReplicasOptimizer(V1.train.GradientDescentOptimizer(0.1),
                                             replicas_to_aggregate=2)
        with pytest.raises(TypeError, match="token queue") as error:
            ms.unroll(lambda: w * w, opt, 3)
        assert "MirroredStrategy" in str(error.value) and "ms.distribute.unroll" in str(error.value)


def test_distribute_unroll_in_a_replica_context_refused():
    """In this process (one device): a single-replica MirroredStrategy."""
    with tf.Graph().as_default():
        strategy = V1.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            w = tf.Variable(1.0)
        opt = V1.train.GradientDescentOptimizer(0.1)

        def replica():
            return ms.distribute.unroll(strategy, lambda: w * w, opt, 2)

        with pytest.raises(RuntimeError, match="cross-replica context"):
            strategy.extended.call_for_each_replica(replica)


def test_reduce_checked():
    with tf.Graph().as_default():
        strategy = V1.distribute.MirroredStrategy(["/cpu:0"])
        with pytest.raises(ValueError, match="reduce must be one of"):
            ms.distribute.unroll(strategy, lambda: tf.constant(0.0), None, 2, reduce="max")


def test_grad_norm_is_the_applied_gradients_norm(results):
    """Under two replicas, grad_norm used to be the mean of the replicas' own norms; it
    is the norm of the summed gradient that the optimizer applies, step by step."""
    got = results["grad_norms"]
    assert len(got["fused"]) == len(got["applied"]) == 6
    assert got["fused"] == got["applied"], got
    assert got["fused"] != got["mean_of_replica_norms"]  # the reference tells them apart


def test_a_run_short_of_batches_applies_nothing_and_says_so(results):
    got = results["remainder"]
    assert got["runs"] == 2 and got["global_step"] == 4, got
    assert "none of its 2 steps were applied" in got["message"], got["message"]
    assert "the global step is now 4" in got["message"], got["message"]
