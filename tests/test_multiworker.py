"""ms.distribute.unroll under tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy,
two worker processes on 127.0.0.1, against the canonical hand-written single distributed
step (call_for_each_replica of compute_gradients + apply_gradients, one sess.run per
step) built beside it in the same graph, on the same servers.

Two rounds of two workers (multistep.cluster starts them with their TF_CONFIG on free
ports and stops them, every wait bounded):
- "train": 2 fused runs of 3 steps beside 6 single steps, compared after each run; the
  chief saves a checkpoint of the fused model; then worker 1 is killed (SIGKILL) in the
  middle of training and worker 0 must fail with ms.distribute.WorkerLostError.
- "resume": two fresh workers restore that checkpoint and make the remaining 2 fused
  runs, beside 12 uninterrupted single steps from the start; then worker 1 stops taking
  part (alive, asleep) and worker 0's next run must fail after the collective timeout.

Each worker builds the same graph in the same order (collective keys are allocated as
ops are built): the fused model first, then the single one.

Parameter servers (one subprocess holding a ps and a worker server): ms.unroll under
replica_device_setter against local opt.minimize single steps."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from multistep.loops.cluster import PORT_TAKEN, PortTakenError, WorkerFailedError, Workers

# one xdist worker runs this file: its module-scoped fixtures are built once
pytestmark = pytest.mark.xdist_group("test_multiworker")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, RUNS, KEPT, TIMEOUT = 3, 4, 2, 5  # as in the worker script

SCRIPT = r'''
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
tf.get_logger().setLevel("ERROR")
import multistep as ms  # noqa: E402

V1 = tf.compat.v1
PHASE, OUT = sys.argv[1], sys.argv[2]
INDEX = int(os.environ["MULTISTEP_WORKER"])
STEPS, RUNS, KEPT, TIMEOUT = 3, 4, 2, 5
GLOBAL_BATCH, LR = 8, 0.1
rng = np.random.RandomState(0)
X = rng.randn(RUNS * STEPS * GLOBAL_BATCH, 3).astype(np.float32)
Y = rng.randn(RUNS * STEPS * GLOBAL_BATCH, 2).astype(np.float32)
W0 = rng.randn(3, 2).astype(np.float32)

strategy = V1.distribute.experimental.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
ms.distribute.set_collective_timeout(strategy, TIMEOUT)
config = strategy.update_config_proto(V1.ConfigProto())
server = tf.distribute.Server(strategy.cluster_resolver.cluster_spec(), job_name="worker",
                              task_index=INDEX, config=config)


def model(scope):
    with strategy.scope(), V1.variable_scope(scope):
        w = V1.get_variable("w", initializer=W0, use_resource=True)
        b = V1.get_variable("b", initializer=np.zeros(2, np.float32), use_resource=True)
        step = V1.get_variable("step", initializer=np.int64(0), trainable=False, use_resource=True,
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def loss_fn(x, y):  # scaled by the global batch: the all-reduce sums the workers' parts
        return tf.reduce_sum(tf.square(tf.matmul(x, w) + b - y)) / GLOBAL_BATCH

    return loss_fn, [w, b], step


def iterator(skip_batches=0):
    data = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(GLOBAL_BATCH)
    return strategy.make_dataset_iterator(data.skip(skip_batches))


# The fused model: N steps a run.
floss, fvars, fstep = model("fused")
fopt = V1.train.AdamOptimizer(LR)
fit = iterator(KEPT * STEPS if PHASE == "resume" else 0)
# Resumed in loop mode: the workers' steps, collectives included, as one loop body, from
# the checkpoint the unrolled steps wrote.
fused = ms.distribute.unroll(strategy, floss, fopt, STEPS, inputs=fit, global_step=fstep,
                             mode="while_loop" if PHASE == "resume" else "unrolled")

# The canonical single distributed step, one sess.run each.
sloss, svars, sstep = model("single")
sopt = V1.train.AdamOptimizer(LR)
sit = iterator()


def single_step(batch):
    x, y = batch
    loss = sloss(x, y)
    train = sopt.apply_gradients(sopt.compute_gradients(loss, var_list=svars), global_step=sstep)
    with tf.control_dependencies([train]):
        return tf.identity(loss)


with strategy.scope():
    per_replica = strategy.extended.call_for_each_replica(single_step, args=(sit.get_next(),))
    single = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

saved = fvars + fopt.variables() + [fstep]
saver = V1.train.Saver(var_list=saved)
init = [V1.global_variables_initializer(), fit.initializer, sit.initializer]
sess = V1.Session(server.target, config=config)
sess.run(init, options=V1.RunOptions(timeout_in_ms=120_000))  # the initial broadcast
ckpt_dir = os.path.join(OUT, "ckpt")
if PHASE == "resume":
    saver.restore(sess, V1.train.latest_checkpoint(ckpt_dir))


def state(variables, opt, step):
    """Roles, not names: the weights by their name in the scope, the optimizer's
    variables in its own (name-sorted) order, the step."""
    keys = [v.name.split("/", 1)[1] for v in variables]
    keys += [f"opt_{i}" for i in range(len(opt.variables()))] + ["step"]
    return dict(zip(keys, sess.run(variables + opt.variables() + [step])))


def compare(a, b):
    return {"bitwise": sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a),
            "keys": sorted(a),
            "max_diff": max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)}


def run_single():
    return np.array(sess.run(single), np.float32)[None]


report = {"runs": []}
if PHASE == "train":
    for r in range(KEPT):
        fused_losses = fused.run(sess)
        single_losses = np.concatenate([run_single() for _ in range(STEPS)])
        f, s = state(fvars, fopt, fstep), state(svars, sopt, sstep)
        report["runs"].append(dict(compare(f, s), losses=fused_losses.tolist(),
                                   losses_bitwise=fused_losses.tobytes() == single_losses.tobytes()))
    if INDEX == 0:  # the chief writes the checkpoint
        saver.save(sess, os.path.join(ckpt_dir, "model"), global_step=KEPT * STEPS)
else:
    for r in range(KEPT, RUNS):
        fused.run(sess)
    for _ in range(RUNS * STEPS):
        run_single()
    f, s = state(fvars, fopt, fstep), state(svars, sopt, sstep)
    report["runs"].append(compare(f, s))
np.savez(os.path.join(OUT, f"{PHASE}_{INDEX}.npz"), **{"fused/" + k: v for k, v in f.items()},
         **{"single/" + k: v for k, v in s.items()})
print("RESULT " + json.dumps(report), flush=True)
print("CHECKPOINTED" if PHASE == "train" else "TRAINED", flush=True)

if PHASE == "resume" and INDEX == 1:
    time.sleep(600)  # alive but no longer taking part: hung, as far as worker 0 can tell
    sys.exit(0)
runs, start = 0, time.monotonic()
try:
    while runs < 100_000:  # training goes on until a peer is lost
        with ms.distribute.catch_lost_worker(strategy):
            fused.run(sess)
        runs += 1
except ms.distribute.WorkerLostError as error:
    print("LOST " + json.dumps({"message": str(error), "cause": type(error.cause).__name__,
                                "peer": error.peer, "timeout": error.timeout, "runs": runs}),
          flush=True)
    sys.exit(3)
print("NOT LOST", flush=True)
'''


def _workers(tmp, phase):
    """The two workers of ``phase``, started (again on new ports if a port was taken),
    once both have printed their results."""
    script = tmp / "worker.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    marker = "CHECKPOINTED" if phase == "train" else "TRAINED"
    for attempt in range(3):
        workers = Workers([sys.executable, str(script), phase, str(tmp)], 2, env=env, cwd=ROOT)
        try:
            for i in (0, 1):
                workers.wait_for(i, marker, timeout=240)
            return workers
        except RuntimeError:
            taken = workers.port_taken()
            workers.stop()
            if not taken or attempt == 2:
                raise
    raise PortTakenError("no free ports in 3 attempts")


def _parse(out, prefix):
    return json.loads(next(x for x in out.splitlines() if x.startswith(prefix))[len(prefix):])


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiworker")
    got = {}
    with _workers(tmp, "train") as workers:
        got["train"] = [_parse(workers.stdout(i), "RESULT ") for i in (0, 1)]
        workers.signal(1, signal.SIGKILL)  # in the middle of training (after the checkpoint)
        [(rc, out, err)] = workers.communicate(timeout=60, which=[0])
        got["killed"] = {"rc": rc, "lost": _parse(out, "LOST ") if "LOST " in out else None,
                         "stderr": err[-3000:]}
    with _workers(tmp, "resume") as workers:
        got["resume"] = [_parse(workers.stdout(i), "RESULT ") for i in (0, 1)]
        [(rc, out, err)] = workers.communicate(timeout=60, which=[0])  # worker 1 asleep
        got["hung"] = {"rc": rc, "lost": _parse(out, "LOST ") if "LOST " in out else None,
                       "stderr": err[-3000:]}
    got["states"] = {f"{phase}_{i}": dict(np.load(tmp / f"{phase}_{i}.npz"))
                     for phase in ("train", "resume") for i in (0, 1)}
    return got


def test_fused_runs_equal_single_distributed_steps_bitwise_on_both_workers(rounds):
    """After each of 2 runs of 3 fused steps, against 3 single distributed steps each:
    the weights, Adam's slots and beta powers and the step, bit for bit, and the losses
    (each step's mean over the two workers), on each worker."""
    for worker in rounds["train"]:
        assert [r["bitwise"] for r in worker["runs"]] == [True, True], worker["runs"]
        assert [r["losses_bitwise"] for r in worker["runs"]] == [True, True]
        assert worker["runs"][0]["keys"] == ["b:0", "opt_0", "opt_1", "opt_2", "opt_3", "opt_4",
                                             "opt_5", "step", "w:0"]  # beta powers + 4 slots


def test_both_workers_end_with_identical_weights(rounds):
    states = rounds["states"]
    for phase in ("train", "resume"):
        a, b = states[f"{phase}_0"], states[f"{phase}_1"]
        assert sorted(a) == sorted(b)
        assert all(a[k].tobytes() == b[k].tobytes() for k in a), phase
    assert int(states["train_0"]["fused/step"]) == KEPT * STEPS
    assert int(states["resume_0"]["fused/step"]) == RUNS * STEPS
    assert not np.array_equal(states["train_0"]["fused/w:0"], states["resume_0"]["fused/w:0"])


def test_a_killed_worker_makes_the_other_fail_with_a_clear_error(rounds):
    """Worker 1 killed with SIGKILL after the checkpoint, while both trained: worker 0's
    run fails and catch_lost_worker re-raises it as WorkerLostError; the process ended
    (exit 3) within communicate's 60 s bound instead of hanging. Which error TensorFlow
    gives depends on where the kill falls: with a request to the dead peer pending, at
    once (UnavailableError, the connection reset, naming the peer); else the next
    collective waits for it and fails after the collective timeout (both seen)."""
    killed = rounds["killed"]
    assert killed["rc"] == 3 and killed["lost"], killed["stderr"]
    lost = killed["lost"]
    assert "restore the last checkpoint" in lost["message"], lost
    if lost["cause"] == "UnavailableError":
        assert lost["peer"] == "/job:worker/replica:0/task:1", lost
        assert "peer /job:worker/replica:0/task:1 is unreachable" in lost["message"], lost
    else:
        assert lost["cause"] == "DeadlineExceededError", lost
        assert f"collective timeout ({TIMEOUT} s)" in lost["message"], lost


def test_a_hung_worker_makes_the_other_fail_after_the_collective_timeout(rounds):
    """Worker 1 alive but no longer taking part (asleep): without a timeout worker 0
    would wait forever; with set_collective_timeout(strategy, 5) its run fails with
    DeadlineExceededError, re-raised as WorkerLostError naming the timeout."""
    hung = rounds["hung"]
    assert hung["rc"] == 3 and hung["lost"], hung["stderr"]
    lost = hung["lost"]
    assert lost["cause"] == "DeadlineExceededError" and lost["timeout"] == TIMEOUT, lost
    assert f"collective timeout ({TIMEOUT} s)" in lost["message"], lost
    assert lost["runs"] == 0


def test_training_resumed_from_the_checkpoint_continues_bitwise(rounds):
    """Two fresh workers restore the chief's checkpoint (after 2 fused runs, unrolled) and
    make runs 3 and 4 in loop mode (the collective all-reduce in the loop body); beside
    them, in the same graph, 12 uninterrupted single steps from the start: every variable
    bit for bit, on both workers."""
    for worker in rounds["resume"]:
        assert worker["runs"][0]["bitwise"], worker["runs"]
    resumed = rounds["states"]["resume_0"]
    for k in ("w:0", "b:0", "step"):
        assert resumed[f"fused/{k}"].tobytes() == resumed[f"single/{k}"].tobytes()


def test_a_failed_worker_stops_its_waiting_peer_and_shows_its_own_error():
    """Worker 0 fails at start-up; worker 1 would wait for it (here: sleep) without end."""
    code = ("import os, sys, time\n"
            "if os.environ['MULTISTEP_WORKER'] == '0':\n"
            "    sys.exit('worker 0: no model here')\n"
            "time.sleep(120)\n")
    with Workers([sys.executable, "-c", code], 2) as workers:
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="(?s)worker 0 failed \\(exit 1\\).*no model here"):
            workers.communicate(timeout=60, grace=1.0)
        assert time.monotonic() - start < 30  # well before the 60 s deadline and the sleep
        assert [p.poll() for p in workers.procs] == [1, -signal.SIGKILL]


def test_catch_lost_worker_lets_other_errors_through():
    import tensorflow as tf

    import multistep as ms

    with pytest.raises(tf.errors.UnavailableError, match="socket closed by a feed"), \
            ms.distribute.catch_lost_worker():
        raise tf.errors.UnavailableError(None, None, "socket closed by a feed")
    with pytest.raises(ValueError, match="seconds must be > 0"):
        ms.distribute.set_collective_timeout(None, 0)


PS_SCRIPT = r"""
import json

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
tf.get_logger().setLevel("ERROR")
import multistep as ms  # noqa: E402
from multistep.loops.cluster import free_ports  # noqa: E402

V1 = tf.compat.v1
ports = free_ports(2)
cluster = tf.train.ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
ps = tf.distribute.Server(cluster, job_name="ps", task_index=0)
worker = tf.distribute.Server(cluster, job_name="worker", task_index=0)
STEPS, RUNS, BATCH = 3, 3, 8
rng = np.random.RandomState(0)
X = rng.randn(RUNS, STEPS, BATCH, 3).astype(np.float32)
Y = rng.randn(RUNS, STEPS, BATCH, 2).astype(np.float32)
W0 = rng.randn(3, 2).astype(np.float32)


def model():
    with V1.variable_scope("dense"):
        w = V1.get_variable("w", initializer=W0)
        b = V1.get_variable("b", initializer=np.zeros(2, np.float32))
    gs = V1.train.get_or_create_global_step()
    return (lambda x, y: tf.reduce_sum(tf.square(tf.matmul(x, w) + b - y)) / BATCH), gs


def optimizer(name):
    return V1.train.AdamOptimizer(0.1) if name == "adam" else V1.train.GradientDescentOptimizer(0.1)


def fused(name, mode, clip):
    graph = tf.Graph()
    with graph.as_default():
        with V1.device(V1.train.replica_device_setter(cluster=cluster,
                                                      worker_device="/job:worker/task:0")):
            loss_fn, gs = model()
            k = V1.placeholder(tf.int32, [])
            inputs = (tf.gather(tf.constant(X), k), tf.gather(tf.constant(Y), k))
            u = ms.unroll(loss_fn, optimizer(name), STEPS, inputs=inputs, global_step=gs, mode=mode,
                          grad_transforms=[ms.clip_by_global_norm(clip)] if clip else [])
        init = V1.global_variables_initializer()
        variables = V1.global_variables()
    sess = V1.Session(worker.target, graph=graph)
    sess.run(init)
    return sess, variables, lambda r: sess.run(u.losses, {k: r})


def single(name, clip):  # the canonical local single step: opt.minimize, one sess.run each
    graph = tf.Graph()
    with graph.as_default():
        loss_fn, gs = model()
        x, y = V1.placeholder(tf.float32, [BATCH, 3]), V1.placeholder(tf.float32, [BATCH, 2])
        loss = loss_fn(x, y)
        opt = optimizer(name)
        if clip:
            grads, tvars = zip(*opt.compute_gradients(loss))
            grads, _ = tf.clip_by_global_norm(grads, clip)
            train = opt.apply_gradients(zip(grads, tvars), global_step=gs)
        else:
            train = opt.minimize(loss, global_step=gs)
        init = V1.global_variables_initializer()
        variables = V1.global_variables()
    sess = V1.Session(graph=graph)
    sess.run(init)
    return sess, variables, lambda r: np.array(
        [sess.run([loss, train], {x: X[r, s], y: Y[r, s]})[0] for s in range(STEPS)], np.float32)


results = {}
for name, mode, clip in [("adam", "unrolled", None), ("sgd", "unrolled", 0.5),
                         ("adam", "while_loop", None)]:
    fs, fv, frun = fused(name, mode, clip)
    ss, sv, srun = single(name, clip)
    runs = []
    for r in range(RUNS):
        got, want = frun(r), srun(r)
        a = dict(zip([v.name for v in fv], fs.run(fv)))
        b = dict(zip([v.name for v in sv], ss.run(sv)))
        runs.append({"same": sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
                             and got.tobytes() == want.tobytes(),
                     "max_diff": max(float(np.max(np.abs(a[n].astype(np.float64) - b[n])))
                                     for n in a if n in b)})
    results[f"{name}_{mode}_{clip}"] = {"runs": runs, "devices": {v.name: v.device for v in fv},
                                        "step": int(a["global_step:0"])}
    fs.close()
    ss.close()
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def ps_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("ps") / "ps.py"
    path.write_text(PS_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    for attempt in range(3):  # again on new ports if one was taken before its server bound it
        done = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        if done.returncode == 0 or not any(s in done.stderr for s in PORT_TAKEN) or attempt == 2:
            break
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.mark.parametrize("case", ["adam_unrolled_None", "sgd_unrolled_0.5", "adam_while_loop_None"])
def test_parameter_server_fused_steps_equal_local_single_steps_bitwise(ps_results, case):
    """Between-graph replication, one ps and one worker (in-process servers on
    127.0.0.1): ms.unroll under replica_device_setter, a session on the worker, the
    variables and every optimizer slot on the ps; 3 runs of 3 steps against 9 local
    opt.minimize steps: every variable by name and the losses, bit for bit."""
    got = ps_results[case]
    assert [r["same"] for r in got["runs"]] == [True] * 3, got["runs"]
    assert got["step"] == 9
    devices = got["devices"]
    assert "dense/w:0" in devices and "global_step:0" in devices
    if case.startswith("adam"):
        assert {"dense/w/Adam:0", "dense/b/Adam_1:0", "beta1_power:0"} <= set(devices)
    assert set(devices.values()) == {"/job:ps/task:0"}, devices
