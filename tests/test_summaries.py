"""TensorBoard output, read back through TensorBoard itself: its event loader and its server."""

import contextlib
import glob
import os
import json
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import multistep as ms
from multistep.tools import cli

# one xdist worker runs this file: its module-scoped fixtures are built once
pytestmark = pytest.mark.xdist_group("test_summaries")

V1 = tf.compat.v1
EPS32 = 2.0 ** -24  # float32 unit roundoff: one rounding moves a value by at most EPS32 relative
STEPS, RUNS = 3, 4


@pytest.fixture(scope="module")
def blobs_logdir(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("tb")
    assert cli.main(["blobs", "--steps", str(STEPS), "--runs", str(RUNS), "--logdir", str(logdir),
                     "--quiet"]) == 0
    return logdir


def load(run_dir):
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return accumulator


def test_each_run_has_a_loss_point_per_inner_step(blobs_logdir):
    fused = load(blobs_logdir / f"fused_{STEPS}").Scalars("loss")
    single = load(blobs_logdir / "single").Scalars("loss")
    assert [e.step for e in fused] == list(range(1, STEPS * RUNS + 1))
    assert [e.step for e in single] == list(range(1, STEPS * RUNS + 1))
    assert [e.value for e in fused] == [e.value for e in single]
    assert fused[-1].value < fused[0].value


def test_graph_holds_the_step_scopes_and_the_control_edges_between_them(blobs_logdir):
    graph_def = load(blobs_logdir / f"fused_{STEPS}").Graph()
    names = {node.name for node in graph_def.node}
    for k in range(1, STEPS + 1):
        for part in ("forward", "apply"):
            assert any(n.startswith(f"multistep/step_{k}/{part}/") for n in names), (k, part)
    for k in range(2, STEPS + 1):
        # An op of step k waits on step k-1's end (after its apply): a control input
        # (^name) into step k.
        assert any(i == f"^multistep/step_{k - 1}/end" and
                   f"multistep/step_{k}/" in node.name
                   for node in graph_def.node for i in node.input), k


def get(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@contextlib.contextmanager
def tensorboard_server(logdir, timeout=120):
    """The real ``tensorboard`` command in its own process on 127.0.0.1 (port 0: the OS picks
    a free one), stopped by the test. Its own process, not a thread of pytest's: TensorBoard's
    reload thread sits in TensorFlow's C++ file reader, and a daemon thread still there when
    the interpreter exits aborts the whole process ("terminate called after throwing an
    instance of ...", exit 134) after every test has passed."""
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
               "127.0.0.1", "--port", "0", "--load_fast", "false", "--reload_interval", "1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    urls = queue.Queue()

    def watch():  # TensorBoard prints "TensorBoard 2.x at http://127.0.0.1:PORT/" on stderr
        for line in process.stderr:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/", line)
            if found:
                urls.put(found.group(1))

    threading.Thread(target=watch, daemon=True).start()
    try:
        try:
            yield urls.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"tensorboard printed no address within {timeout} s") from None
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def test_tensorboard_server_serves_the_runs_scalars_and_graph(blobs_logdir):
    with tensorboard_server(blobs_logdir) as base:
        deadline = time.time() + 60
        while True:
            runs = json.loads(get(base + "/data/runs"))
            tags = json.loads(get(base + "/data/plugin/scalars/tags"))
            if (sorted(runs) == ["fused_3", "single"]
                    and all("loss" in tags.get(r, {}) for r in runs)) or time.time() > deadline:
                break
            time.sleep(0.5)
        assert sorted(runs) == ["fused_3", "single"]
        curves = {}
        for run in runs:
            points = json.loads(get(f"{base}/data/plugin/scalars/scalars?run={run}&tag=loss"))
            assert [step for _, step, _ in points] == list(range(1, STEPS * RUNS + 1))
            curves[run] = [value for _, _, value in points]
        assert curves["fused_3"] == curves["single"]
        graph = get(f"{base}/data/plugin/graphs/graph?run=fused_3")
        assert 'name: "multistep/step_3/apply/GradientDescent"' in graph
        assert re.search(r'input: "\^multistep/step_2/apply/GradientDescent"', graph)
        print("runs:", sorted(runs), "tags:", {r: sorted(t) for r, t in tags.items()})


def test_graph_command_lists_steps_and_cross_step_edges(capsys, tmp_path):
    assert cli.main(["graph", "--steps", "3", "--logdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^(step_\d+): \d+ ops", out, re.M) == ["step_1", "step_2", "step_3"]
    assert re.findall(r"^  (step_\d+ -> step_\d+): \d+ control inputs?$", out, re.M) == [
        "step_1 -> step_2", "step_2 -> step_3"]
    assert "reads dense/kernel: forward/MatMul/ReadVariableOp" in out
    assert list(tmp_path.iterdir())


def test_graph_command_in_loop_mode_shows_one_body(capsys, tmp_path):
    assert cli.main(["graph", "--steps", "50", "--mode", "while_loop", "--logdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^(step_\d+|loop): \d+ ops", out, re.M) == ["loop"]


def test_records_give_grad_norm_and_learning_rate_per_step():
    x = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
    t = np.array([1.0, 0.0], np.float32)
    with tf.Graph().as_default():
        w = V1.get_variable("w", [2], initializer=V1.zeros_initializer())
        gs = V1.train.get_or_create_global_step()
        opt = V1.train.GradientDescentOptimizer(lambda: V1.train.exponential_decay(0.1, gs, 1, 0.5))
        fused = ms.unroll(lambda: tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - t)), opt, 4,
                          global_step=gs, record=["grad_norm", "learning_rate"], mode="while_loop")
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            _, norms, rates = sess.run([fused.train_op, fused.records["grad_norm"],
                                        fused.records["learning_rate"]])
    # float32 0.1 * 0.5^t: 0.1 -> float32 (u), pow(0.5, t) (<= 1 ulp: 2u), the product (u):
    # rtol = 4u, u = 2^-24 (was 1e-6, looser than derived).
    np.testing.assert_allclose(rates, [0.1, 0.05, 0.025, 0.0125], rtol=4 * EPS32)
    # The norms against a float64 run, with a bound carried along it (u = EPS32; first order).
    # Per step TF computes r = xw - t (2-term dot and a subtraction: 3u(|x||w| + |t|)), g = x^T r
    # (the mean's 1/2 and the square's 2 are exact; 2-term dots: 2u|x|^T|r|), plus the error
    # e_w already in w, passed on through |x| twice: e_g = |x|^T(|x| e_w + 3u(|x||w| + |t|)) +
    # 2u|x|^T|r|. Then w - lr*g with lr within 4u (above) and one product and one subtraction:
    # e_w' = e_w + lr e_g + 5u lr|g| + u|w'|. ||w - w_np|| cannot grow: I - lr x^T x has
    # eigenvalues in [-0.02, 0.94] for these lr, and the componentwise |x| propagation above
    # bounds it anyway. global_norm (squares, a 2-term sum, sqrt) is within 4u relative:
    # |norm - norm_np| <= ||e_g||_2 + 4u||g||. Safety factor 2: first order in u (dropped terms
    # ~1e-12 relative) and magnitudes taken from the float64 run (1e-6 relative away).
    w_np, e_w, want, bound = np.zeros(2), np.zeros(2), [], []
    ax = np.abs(x.astype(np.float64))
    for lr in [0.1, 0.05, 0.025, 0.0125]:
        r = x @ w_np - t
        g = 2 / len(x) * x.T @ r
        e_g = ax.T @ (ax @ e_w + 3 * EPS32 * (ax @ np.abs(w_np) + np.abs(t))) + 2 * EPS32 * ax.T @ np.abs(r)
        want.append(np.linalg.norm(g))
        bound.append(2 * (np.linalg.norm(e_g) + 4 * EPS32 * np.linalg.norm(g)))
        w_np = w_np - lr * g
        e_w = e_w + lr * e_g + 5 * EPS32 * lr * np.abs(g) + EPS32 * np.abs(w_np)
    # Was rtol=1e-5, looser than derived; now the derived absolute bound per step.
    assert (np.abs(norms - np.array(want)) <= np.array(bound)).all(), (norms, want, bound)


def test_bad_record_name():
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        with pytest.raises(ValueError, match="record: unknown quantity 'lr'"):
            ms.unroll(lambda: w * w, V1.train.GradientDescentOptimizer(0.1), 2, record=["lr"])


def test_write_steps_places_points_at_their_global_steps(tmp_path):
    with tf.Graph().as_default():
        writer = V1.summary.FileWriter(str(tmp_path))
    ms.summaries.write_steps(writer, 7, {"loss": [3.0, 2.0], "grad_norm": [1.5, 0.5]})
    writer.close()
    accumulator = load(tmp_path)
    assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [(7, 3.0), (8, 2.0)]
    assert [(e.step, e.value) for e in accumulator.Scalars("grad_norm")] == [(7, 1.5), (8, 0.5)]


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_every_op_but_the_variables_own_lies_under_its_step(mode):
    # TensorBoard folds the graph into multistep/step_k blocks only if nothing, gradients
    # included, sits beside them: outside multistep/ there may be only the variables
    # themselves (made under their single-step names) and their initialisers and reads.
    from multistep.tools import blobs

    graph = tf.Graph()
    with graph.as_default():
        blobs.build(3, optimizer="adam", mode=mode)
        owners = [v.op.name for v in V1.global_variables()]
    outside = [op.name for op in graph.get_operations() if not op.name.startswith("multistep/")]
    strays = [name for name in outside
              if not any(name == owner or name.startswith(owner + "/") for owner in owners)]
    assert strays == []
    steps = {op.name.split("/")[1] for op in graph.get_operations() if op.name.startswith("multistep/")}
    assert {"step_1", "step_2", "step_3"} <= steps or mode == "while_loop"


def cifar_model(x, y):
    """The CIFAR-10 tutorial's idioms in one loss: a weight-decay term and the data loss
    in the 'losses' collection, their sum over it; an average of the loss in a variable of
    its own (the fix ms.unroll names for ExponentialMovingAverage.apply([loss])), through
    UPDATE_OPS; tf.summary scalars and a histogram of an activation in the model."""
    w = tf.compat.v1.get_variable("dense/kernel", initializer=np.full((3, 2), 0.2, np.float32))
    average = tf.compat.v1.get_variable("loss_average", initializer=0.0, trainable=False)
    h = tf.tanh(tf.matmul(x, w))
    tf.compat.v1.add_to_collection("losses", tf.multiply(tf.nn.l2_loss(w), 0.004, name="decay"))
    tf.compat.v1.add_to_collection("losses", tf.reduce_mean(tf.square(h - y), name="data"))
    total = tf.add_n(tf.compat.v1.get_collection("losses"), name="total_loss")
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS,
                                   average.assign(0.9 * average + 0.1 * total))
    for term in tf.compat.v1.get_collection("losses"):
        tf.compat.v1.summary.scalar(term.op.name.split("/")[-1], term)
    tf.compat.v1.summary.histogram("activations", h)
    # The tutorial's _activation_summary: a tag built from the op's name (issue 28: the
    # fused steps wrote it under the step's scope).
    tf.compat.v1.summary.scalar(h.op.name + "/sparsity", tf.nn.zero_fraction(h))
    # Named as the variable: a single step's tag takes a suffix, "dense/kernel_1" (issue 28).
    tf.compat.v1.summary.histogram("dense/kernel", w)
    return total


def _values(monitored):
    """Every global variable, read without running the hooks (run_step_fn's raw session)."""
    variables = tf.compat.v1.global_variables()
    return monitored.run_step_fn(lambda step_context: dict(zip(
        [v.op.name for v in variables], step_context.session.run(variables))))


def _events(directory):
    """{(tag, global step): what was written} of every summary value in ``directory``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                written = value.simple_value if value.HasField("simple_value") else value.histo
                out[(value.tag, event.step)] = written.SerializeToString() if hasattr(
                    written, "SerializeToString") else written
    return out


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_summaries_in_loss_fn_are_written_per_inner_step(tmp_path, mode):
    """Canonical single steps under MonitoredTrainingSession with TensorFlow's
    SummarySaverHook(save_steps=1) against the fused steps with ms.hooks.StepSummaryHook:
    every tag of loss_fn's summaries at every global step, equal (used to be: step 1's
    summary ops only, once per run), and every variable bitwise."""
    x_all = np.random.RandomState(3).randn(6, 8, 3).astype(np.float32)
    y_all = np.random.RandomState(4).randn(6, 8, 2).astype(np.float32)
    V1 = tf.compat.v1
    with tf.Graph().as_default():
        x, y = V1.placeholder(tf.float32, [8, 3]), V1.placeholder(tf.float32, [8, 2])
        gs = V1.train.get_or_create_global_step()
        loss = cifar_model(x, y)
        with tf.control_dependencies(V1.get_collection(V1.GraphKeys.UPDATE_OPS)):
            train = V1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=gs)
        hook = V1.train.SummarySaverHook(save_steps=1, output_dir=str(tmp_path / "single"),
                                         summary_op=V1.summary.merge_all())
        with V1.train.MonitoredSession(hooks=[hook]) as sess:
            for k in range(6):
                sess.run(train, {x: x_all[k], y: y_all[k]})
            want = _values(sess)
    with tf.Graph().as_default():
        xs, ys = V1.placeholder(tf.float32, [3, 8, 3]), V1.placeholder(tf.float32, [3, 8, 2])
        gs = V1.train.get_or_create_global_step()
        unrolled = ms.unroll(cifar_model, V1.train.GradientDescentOptimizer(0.1), 3,
                             inputs=(xs, ys), global_step=gs, mode=mode)
        hook = ms.hooks.StepSummaryHook(unrolled, str(tmp_path / "fused"))
        with V1.train.MonitoredSession(hooks=[hook]) as sess:
            for r in range(2):
                sess.run(unrolled.train_op, {xs: x_all[3 * r:3 * r + 3], ys: y_all[3 * r:3 * r + 3]})
            got = _values(sess)
    V1.summary.FileWriterCache.clear()  # (its writers' threads)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    single, fused = _events(tmp_path / "single"), _events(tmp_path / "fused")
    # TensorFlow's tags: the scalars' op names were taken by the terms, so "decay_1", "data_1".
    assert {tag for tag, _ in single} == {"decay_1", "data_1", "activations", "Tanh/sparsity",
                                          "dense/kernel_1"}
    assert sorted(k for k in single if k[1] >= 1) == sorted(k for k in fused if k[0] != "loss")
    for key in single:
        if key[1] >= 1:  # SummarySaverHook also writes at global step 0, before the first apply
            assert fused[key] == single[key], key


def test_a_tf2_summary_in_loss_fn_is_refused_saying_why_at_the_users_line(tmp_path):
    """Issue 28: the refusal said a single step would not run it either (false: a single
    step fetches tf.compat.v1.summary.all_v2_summary_ops()) and pointed into TensorBoard's
    source."""
    with tf.Graph().as_default():
        step = V1.train.get_or_create_global_step()
        with tf.summary.create_file_writer(str(tmp_path)).as_default():
            def loss_fn():
                w = V1.get_variable("w", initializer=1.0)
                loss = w * w
                tf.summary.scalar("loss", loss, step=step)  # the user's line
                return loss

            with pytest.raises(ValueError) as info:
                ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 3, global_step=step)
    message = str(info.value)
    assert "TF2 summary op" in message and "all_v2_summary_ops()" in message
    assert "tf.compat.v1.summary.scalar" in message
    assert f"at {__file__}:" in message and "(in loss_fn)" in message
    assert "tensorboard" not in message.split(" at ", 1)[1].split(")", 1)[0]
