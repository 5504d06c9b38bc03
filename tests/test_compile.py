"""ms.compile: the user's single step as written, N times in one sess.run, against the
same program's own single sess.run calls.

The programs (tests/compile_cases.py) run in a subprocess per preamble and oneDNN
setting (both are process-global): every variable, slot and fetched value bitwise, each
compiled step executing the single step's kernels (partition graphs, by name within
the step), and in unrolled mode every read of step k descending from a write of step
k-1 in the executed graph. The rest runs in this process, in graphs of its own.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
WORKER = pathlib.Path(__file__).with_name("compile_cases.py")
PROGRAMS = ["mlp_dropout", "nce", "rnn", "batch_norm", "dataset", "gan", "summaries"]
# Stateful random ops whose stream is not shared (multistep.compiler.streams): a
# candidate sampler has no stateless twin. (The dropout's stream is shared: its unrolled
# copies draw the single steps' numbers, and mlp_dropout compiles in both modes.)
RANDOM = {"nce": "nce_loss/LogUniformCandidateSampler"}


@pytest.mark.parametrize("onednn", ["1", "0"])
@pytest.mark.parametrize("preamble", ["disable_eager_execution", "disable_v2_behavior"])
def test_programs_as_written_are_bitwise_with_their_single_steps(preamble, onednn):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_USE_LEGACY_KERAS="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    cases = [f"{p}:{mode}" for p in PROGRAMS for mode in ("unrolled", "while_loop")]
    result = subprocess.run([sys.executable, str(WORKER), preamble, *cases], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == cases
    for row in rows:
        program, mode = row["case"].split(":")
        if program in RANDOM and mode == "unrolled":
            # Each unrolled copy of a random op with a stream of its own restarts it: refused.
            assert RANDOM[program] in row["refused"] and "mode='while_loop'" in row["refused"]
            continue
        assert "refused" not in row, row
        assert row["max_delta"] == 0.0, (row["case"], {k: v for k, v in row["deltas"].items() if v})
        assert row["kernel_difference"] is None, (row["case"], row["kernel_difference"])
        # the dropout draws through its shared stream (in both modes), nothing else does
        assert row["streams"] == (["dropout/random_uniform/RandomUniform"]
                                  if program == "mlp_dropout" else []), row["streams"]
        assert row["kernels"] > 5, row  # the comparison saw the step's kernels
        assert row["steps"] == (["1", "2", "3"] if mode == "unrolled" else ["1..N"]), row
        assert row["unordered_reads"] == [], (row["case"], row["unordered_reads"])


def _seed_004(graph):
    """Seed 004's program as written: a dense layer, Adam, a global step, one batch."""
    with graph.as_default():
        x = V1.placeholder(tf.float32, [None, 3], name="x")
        y = V1.placeholder(tf.float32, [None, 1], name="y")
        w = V1.get_variable("w", initializer=np.full([3, 1], 0.5, np.float32))
        b = V1.get_variable("b", initializer=np.zeros([1], np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
        step = V1.train.get_or_create_global_step()
        train = V1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
    return x, y, loss, train


_rng = np.random.RandomState(4)
X, Y = _rng.randn(16, 3).astype(np.float32), _rng.randn(16, 1).astype(np.float32)


def _state(sess):
    return {v.op.name: sess.run(v) for v in V1.global_variables()
            if not v.op.name.startswith("multistep/")}


def _single_steps(count, feed=lambda k: (X, Y)):
    graph = tf.Graph()
    x, y, loss, train = _seed_004(graph)
    with V1.Session(graph=graph) as sess:
        sess.run(V1.variables_initializer(graph.get_collection("variables")))
        losses = [sess.run([loss, train], dict(zip((x, y), feed(k))))[0] for k in range(count)]
        return np.array(losses, np.float32), _state(sess)


def _bitwise(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.asarray(a[name]).tobytes() == np.asarray(b[name]).tobytes(), name


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_the_same_batch_every_step_needs_no_leading_dimension(mode):
    want_losses, want = _single_steps(15)
    graph = tf.Graph()
    x, y, loss, train = _seed_004(graph)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=5, mode=mode)
        init = [V1.global_variables_initializer(), V1.local_variables_initializer()]
    with V1.Session(graph=graph) as sess:
        sess.run(init)
        losses = np.concatenate([fused.run(sess, {x: X, y: Y})[0] for _ in range(3)])
        got = _state(sess)
    assert losses.tobytes() == want_losses.tobytes()
    _bitwise(got, want)
    assert fused.global_step is not None and fused.losses is not None


def test_a_shortened_loop_run_takes_its_own_batches():
    """set_steps_per_run(2) after a run of 4: the next run takes exactly 2 batches, bitwise
    with 6 single steps; 4 batches fed to a run of 2 are refused before any step runs."""
    batches = _rng.randn(6, 16, 3).astype(np.float32)
    want_losses, want = _single_steps(6, lambda k: (batches[k], Y))
    graph = tf.Graph()
    x, y, loss, train = _seed_004(graph)
    with graph.as_default():
        fused = ms.compile({"loss": loss, "train": train}, steps=4)
        init = [V1.global_variables_initializer(), V1.local_variables_initializer()]
    with V1.Session(graph=graph) as sess:
        sess.run(init)
        first = fused.run(sess, {x: batches[:4], y: Y})["loss"]
        fused.set_steps_per_run(sess, 2)
        before = _state(sess)
        with pytest.raises(tf.errors.InvalidArgumentError, match="one batch per step"):
            fused.run(sess, {x: batches[2:6], y: Y})
        _bitwise(_state(sess), before)  # refused before any step ran
        second = fused.run(sess, {x: batches[4:6], y: Y})["loss"]
        got = _state(sess)
    assert np.concatenate([first, second]).tobytes() == want_losses.tobytes()
    _bitwise(got, want)


def test_bad_feeds_and_fetches_are_refused_by_name():
    graph = tf.Graph()
    x, y, loss, train = _seed_004(graph)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=3, mode="unrolled")
        with pytest.raises(TypeError, match="fetch 0 is int"):
            ms.compile([3, train], steps=3)
        with pytest.raises(ValueError, match="fetch 0, 'nothing:0'"):
            ms.compile(["nothing:0", train], steps=3)
        by_name = ms.compile([loss.name, train.name], steps=2, name="by_name")
        assert by_name.losses is not None and by_name.values[1] is by_name.train_op
        with pytest.raises(ValueError, match="steps must be an int >= 1"):
            ms.compile([loss, train], steps=0)
        with pytest.raises(ValueError, match="mode must be one of"):
            ms.compile([loss, train], steps=2, mode="fast")
        with pytest.raises(ValueError, match="feeds names 'z'"):
            ms.compile([loss, train], steps=2, feeds=[V1.placeholder(tf.float32, name="z")])
    with pytest.raises(ValueError, match=r"'x:0' has shape \(2, 2, 2, 3\)"):
        fused.feed_dict({x: np.zeros([2, 2, 2, 3], np.float32)})
    with pytest.raises(TypeError, match="needs mode='while_loop'"):
        fused.set_steps_per_run(None, 2)


def test_a_placeholder_left_out_of_feeds_is_shared_by_the_steps():
    """feeds=[x, y]: a learning-rate placeholder is fed once per run, as it is."""
    graph = tf.Graph()
    with graph.as_default():
        x = V1.placeholder(tf.float32, [None, 3])
        rate = V1.placeholder(tf.float32, [], name="rate")
        w = V1.get_variable("w", initializer=np.ones([3, 1], np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        train = V1.train.GradientDescentOptimizer(rate).minimize(loss)
        fused = ms.compile([loss, train], steps=2, feeds=[x])
        init = V1.global_variables_initializer()
    assert list(fused.inputs) == [x]
    with V1.Session(graph=graph) as sess:
        sess.run(init)
        fused.run(sess, {x: X[None].repeat(2, 0), rate: 0.01})
        got = sess.run(w)
    want = np.ones([3, 1], np.float32)
    for _ in range(2):  # plain gradient descent on the mean squared output, in float32
        grad = (2.0 / len(X)) * X.T @ (X @ want)
        want = want - np.float32(0.01) * grad.astype(np.float32)
    # Two float32 steps of sums over 16 rows of 3 terms each: the numpy and TensorFlow sums
    # may associate differently, a few float32 ulps of the weights' magnitude (~1).
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * 2.0 ** -23 * 16)


def test_an_op_that_makes_unknown_state_is_refused(monkeypatch):
    """An op that makes state the rule does not know (tests/test_placement.py audits the
    registry, so such an op is one a later TensorFlow adds: simulated by taking
    AnonymousSeedGenerator out of the rule) is refused by name."""
    from multistep.compiler import placement
    monkeypatch.setattr(placement, "STATE_OWNERS",
                        placement.STATE_OWNERS - {"AnonymousSeedGenerator"})
    graph = tf.Graph()
    with graph.as_default():
        accumulator = tf.raw_ops.AnonymousSeedGenerator(seed=1, seed2=2, reshuffle=False)
        fetch = tf.identity(accumulator[1])
        with pytest.raises(ValueError, match="AnonymousSeedGenerator"):
            ms.compile([fetch], steps=2)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_verify_takes_a_compiled_program(mode):
    batches = _rng.randn(12, 16, 3).astype(np.float32)

    def build(steps):
        x, y, loss, train = _seed_004(V1.get_default_graph())
        fused = ms.compile({"loss": loss, "train": train}, steps, mode=mode)
        return fused, lambda r: {x: batches[r * steps:(r + 1) * steps], y: Y}

    report = ms.verify(build, steps=3, runs=4, explain=True)
    assert report.ok and report.bitwise, report
    assert report.same_kernels is True, report.summary()


def _summary_program(graph):
    """A tf.data-fed MLP with a scalar and a histogram summary and a global step."""
    with graph.as_default():
        data = tf.data.Dataset.from_tensor_slices((_BATCHES, _LABELS)).repeat()
        x, y = V1.data.make_one_shot_iterator(data).get_next()
        h = tf.tanh(tf.matmul(x, V1.get_variable("w1", initializer=np.full([3, 4], 0.3, np.float32))))
        logits = tf.matmul(h, V1.get_variable("w2", initializer=np.full([4, 2], -0.2, np.float32)))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        V1.summary.scalar("xent", loss)
        V1.summary.histogram("hidden", h)
        train = V1.train.GradientDescentOptimizer(0.5).minimize(
            loss, global_step=V1.train.get_or_create_global_step())
        merged = V1.summary.merge_all()
        # TensorFlow's FinalOpsHook reads the variables once the session ends.
        final = V1.train.FinalOpsHook({v.op.name: v.read_value() for v in V1.global_variables()})
    return loss, train, merged, final


_BATCHES = _rng.randn(7, 16, 3).astype(np.float32)
_LABELS = _rng.randint(0, 2, size=(7, 16)).astype(np.int32)


def _events(directory, tags):
    """(global step, tag, serialized value) of every summary value written under ``tags``."""
    found = []
    for path in sorted(pathlib.Path(directory).glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag in tags:
                    found.append((event.step, value.tag, value.SerializeToString()))
    return sorted(found)


def test_monitored_training_with_ms_hooks_equals_tensorflows_hooks(tmp_path):
    """MonitoredTrainingSession to global step 10 in runs of 4 (the last shortened to 2 by
    ms.hooks.StopAtStepHook), each step's summaries written by ms.hooks.StepSummaryHook,
    against single steps under TensorFlow's own StopAtStepHook and
    SummarySaverHook(save_steps=1): the same weights, and the same summaries at the same
    global steps."""
    graph = tf.Graph()
    loss, train, merged, final = _summary_program(graph)
    with graph.as_default():
        hooks = [V1.train.StopAtStepHook(last_step=10), final,
                 V1.train.SummarySaverHook(save_steps=1, output_dir=str(tmp_path / "single"),
                                           summary_op=merged)]
        with V1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run(train)
    want = final.final_ops_values
    graph = tf.Graph()
    loss, train, merged, final = _summary_program(graph)
    with graph.as_default():
        fused = ms.compile({"loss": loss, "summary": merged, "train": train}, steps=4)
        hooks = [ms.hooks.StopAtStepHook(fused, 10), final,
                 ms.hooks.StepSummaryHook(fused, str(tmp_path / "fused"))]
        runs = 0
        with V1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                fused.run(sess)
                runs += 1
    got = final.final_ops_values
    V1.summary.FileWriterCache.clear()  # (its writers' threads)
    assert runs == 3
    _bitwise(got, want)
    assert int(got["global_step"]) == 10
    tags = {"xent", "hidden"}
    single, compiled = _events(tmp_path / "single", tags), _events(tmp_path / "fused", tags)
    assert [(step, tag) for step, tag, _ in single] == [
        (step, tag) for step in range(1, 11) for tag in sorted(tags)]
    assert compiled == single


def test_copies_keep_the_originals_names_colocation_and_devices():
    graph = tf.Graph()
    with graph.as_default(), tf.device("/device:CPU:0"):
        x, y, loss, train = _seed_004(graph)
    original = graph.get_operation_by_name("Adam/update_w/ResourceApplyAdam")
    assert original.colocation_groups() == [b"loc:@w"]
    with graph.as_default():
        ms.compile([loss, train], steps=2, mode="unrolled")
    for k in (1, 2):
        copy = graph.get_operation_by_name(f"multistep/step_{k}/Adam/update_w/ResourceApplyAdam")
        assert copy.colocation_groups() == [b"loc:@w"]  # the shared variable itself
        assert copy.device == original.device == "/device:CPU:0"
        assert copy.inputs[0] is original.inputs[0]  # the shared handle
        grad = graph.get_operation_by_name(f"multistep/step_{k}/gradients/MatMul_grad/MatMul_1")
        assert grad.colocation_groups() == [f"loc:@{grad.name}".encode()]  # its own, as before


def test_unrolled_copies_of_a_collective_take_keys_of_their_own():
    """N copies of one instance key would meet as one collective: copy k takes the key
    plus k * 2**20. A group of one runs in a plain session: bitwise with three single
    runs of the step."""
    def program():
        w = V1.get_variable("w", initializer=np.ones([2], np.float32))
        total = tf.raw_ops.CollectiveReduceV2(
            input=w.read_value(), group_size=1, group_key=1, instance_key=1,
            ordering_token=[], merge_op="Add", final_op="Id")
        return w, w.assign_sub(0.1 * total)

    got = {}
    for fused in (True, False):
        with tf.Graph().as_default() as graph, V1.Session() as sess:
            w, train = program()
            if fused:
                train = ms.compile([train], steps=3, mode="unrolled").train_op
                keys = sorted(int(tf.get_static_value(op.inputs[3]))
                              for op in graph.get_operations()
                              if op.type == "CollectiveReduceV2" and "/step_" in op.name)
                assert keys == [1, 1 + 2 ** 20, 1 + 2 * 2 ** 20]
            sess.run(w.initializer)
            for _ in range(1 if fused else 3):
                sess.run(train)
            got[fused] = sess.run(w)
    assert got[True].tobytes() == got[False].tobytes()


def _xla_program(w0, inside=False):
    """An MLP with Adam and a cond on a training switch; ``inside``: the cond's branches
    compute what its gradient needs (kept as Optionals outside an XLA context)."""
    x, y = V1.placeholder(tf.float32, [16, 8]), V1.placeholder(tf.int32, [16])
    w = V1.get_variable("w", initializer=w0)
    training = V1.placeholder_with_default(True, [])
    if inside:
        h = tf.cond(training, lambda: tf.matmul(x, w) * 0.5, lambda: tf.matmul(x, w))
    else:
        h = tf.matmul(x, w)
        h = tf.cond(training, lambda: h * 0.5, lambda: h)  # lowered in a graph
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
    return x, y, loss, V1.train.AdamOptimizer(0.1).minimize(
        loss, global_step=V1.train.get_or_create_global_step())


def test_xla_loop_is_bitwise_with_the_step_compiled_alone():
    """xla=True (loop mode): 2 runs of 3 steps against 6 runs of the step compiled alone
    (steps=1), every variable bit for bit; a cond built in the graph (lowered) compiles
    whole. Unrolled copies in one XLA program are refused (XLA simplifies across them)."""
    rng = np.random.RandomState(0)
    w0 = rng.randn(8, 3).astype(np.float32) * 0.1
    xs, ys = rng.randn(6, 16, 8).astype(np.float32), rng.randint(0, 3, (6, 16)).astype(np.int32)
    out = []
    for steps in (3, 1):
        with tf.Graph().as_default(), V1.Session() as sess:
            x, y, loss, train = _xla_program(w0)
            fused = ms.compile([loss, train], steps, xla=True, feeds=[x, y])
            assert fused.mode == "while_loop+xla"
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            for r in range(6 // steps):
                fused.run(sess, {x: xs[r * steps:(r + 1) * steps], y: ys[r * steps:(r + 1) * steps]})
            out.append({v.op.name: sess.run(v) for v in V1.global_variables()})
    assert sorted(out[0]) == sorted(out[1])
    assert all(out[0][n].tobytes() == out[1][n].tobytes() for n in out[0])
    with tf.Graph().as_default():
        _, _, loss, train = _xla_program(w0)
        with pytest.raises(ValueError, match="xla=True with mode='unrolled' is refused"):
            ms.compile([loss, train], 3, mode="unrolled", xla=True)


def test_xla_refuses_a_step_it_cannot_compile_at_build_naming_the_op():
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=1.0)
        loss = tf.square(w) + tf.strings.to_number(tf.strings.as_string(w))  # string ops
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(ValueError, match=r"cannot compile: op type 'AsString'"):
            ms.compile([loss, train], 3, xla=True)
    with tf.Graph().as_default():
        _, _, loss, train = _xla_program(np.ones([8, 3], np.float32), inside=True)
        with pytest.raises(ValueError, match=r"'OptionalFromValue'.*the gradient of a tf.cond"):
            ms.compile([loss, train], 3, xla=True)


def test_too_many_unrolled_copies_of_a_collective_are_refused():
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=np.ones([2], np.float32))
        total = tf.raw_ops.CollectiveReduceV2(
            input=w.read_value(), group_size=1, group_key=1, instance_key=1,
            ordering_token=[], merge_op="Add", final_op="Id")
        with pytest.raises(ValueError, match=r"keys of their own.*up to 2047 copies"):
            ms.compile([w.assign_sub(total)], steps=2048, mode="unrolled")


def _scaled_program(graph):
    with graph.as_default():
        x = V1.placeholder(tf.float32, [None, 3], name="x")
        scale = V1.placeholder_with_default(1.0, [], name="scale")
        w = V1.get_variable("w", initializer=np.full([3, 1], 0.5, np.float32))
        hidden = tf.matmul(x, w, name="hidden")
        loss = tf.reduce_mean(tf.square(hidden)) * scale
        train = V1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return x, scale, hidden, loss, train


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_a_placeholder_with_default_is_a_per_step_input_that_keeps_its_default(mode):
    """Fed one value per step, one value for all, or not at all (its default), bitwise with
    single steps fed alike; a tensor computed inside the step is refused as a feed key
    (fed to the original it would reach no copy)."""
    scales = np.array([0.5, 0.25, 2.0], np.float32)
    feeds = [lambda k: {"scale": scales[k]}, lambda k: {"scale": np.float32(0.5)}, lambda k: {}]
    for feed in feeds:
        graph = tf.Graph()
        x, scale, hidden, loss, train = _scaled_program(graph)
        with V1.Session(graph=graph) as sess:
            sess.run(V1.variables_initializer(graph.get_collection("variables")))
            for k in range(3):
                given = {scale: v for v in feed(k).values()}
                sess.run(train, {x: X, **given})
            want = _state(sess)
        graph = tf.Graph()
        x, scale, hidden, loss, train = _scaled_program(graph)
        with graph.as_default():
            fused = ms.compile([loss, train], steps=3, mode=mode)
            init = [V1.global_variables_initializer(), V1.local_variables_initializer()]
        given = {}
        if feed(0):
            same = all(float(feed(k)["scale"]) == float(feed(0)["scale"]) for k in range(3))
            given = {scale: feed(0)["scale"] if same else scales}
        with V1.Session(graph=graph) as sess:
            sess.run(init)
            fused.run(sess, {x: X, **given})
            _bitwise(_state(sess), want)
        with pytest.raises(ValueError, match="'hidden:0' is computed inside the step"):
            fused.feed_dict({hidden: np.zeros([16, 1], np.float32)})
