"""Issue 36: programs an adversarial user writes, through ``ms.compile``: each bitwise with
the program's own single ``sess.run`` calls, or refused (warned) before a step is applied
with a message that names the op or argument and the fix. Tests are named by case."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms
from test_compile import _bitwise as _same  # (every variable, bit for bit)
from test_compile import _state as _globals  # (the program's variables, not multistep's)

V1 = tf.compat.v1
_rng = np.random.RandomState(36)
XS = _rng.randn(6, 4, 3).astype(np.float32)


def _dense_program(dropout=None, ref=False):
    """x -> w -> (dropout) -> squared error; SGD, a global step. ``dropout``: None,
    "cond" (v2 tf.cond on a training switch), or "function" (a tf.function helper)."""
    x = V1.placeholder(tf.float32, [None, 3], "x")
    w = V1.get_variable("w", initializer=np.full([3, 2], 0.3, np.float32),
                        use_resource=not ref)
    h = tf.matmul(x, w)
    if dropout == "cond":
        training = V1.placeholder_with_default(True, [], "training")
        h = tf.cond(training, lambda: tf.nn.dropout(h, rate=0.5, seed=7), lambda: h)
    elif dropout == "plain":
        h = tf.nn.dropout(h, rate=0.5, seed=7)
    elif dropout == "function":
        h = tf.function(lambda t: tf.nn.dropout(t, rate=0.5, seed=7))(h)
    loss = tf.reduce_mean(tf.square(h - 1.0))
    gs = V1.train.get_or_create_global_step()
    train = V1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=gs)
    return x, loss, train, gs


@pytest.mark.parametrize("where", ["cond", "function"])
def test_case01_a_random_op_inside_a_function_is_refused_in_unrolled_mode(where):
    """A dropout inside a v2 tf.cond branch or a tf.function: each unrolled copy would
    restart its stream. On main it built and ran silently (weights 0.27 apart)."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program(dropout=where)
        with pytest.raises(ValueError, match=r"RandomUniform\) in a function .* mode='while_loop'"):
            ms.compile([loss, train], steps=3, mode="unrolled")


def test_case02_loop_mode_over_random_ops_warns_when_its_draws_are_the_programs():
    """A random op whose stream is not shared (here inside a v2 tf.cond's branch, a
    function the streams do not rewire): the build says so in one sentence, naming the op,
    why, and what breaks it. On main: no warning."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program(dropout="cond")
        with pytest.warns(RuntimeWarning, match=r"RandomUniform.*kernel's own stream \(inside a "
                                                r"function.*another copy of it runs") as caught:
            ms.compile([loss, train], steps=3)
    assert len(str(caught[0].message)) < 400  # (it was 834 characters)


def test_case03_a_placeholder_without_a_shape_fed_a_batch_is_refused_with_the_fix():
    """An unknown rank makes "one batch a step" and "this batch every step" the same
    feed: refused before any step, naming the placeholder and both fixes. On main each
    step trained on one row."""
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, name="x_no_shape")
        w = V1.get_variable("w", initializer=np.ones([3, 1], np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        fused = ms.compile([loss, train], steps=4)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            before = sess.run(w)
            with pytest.raises(ValueError, match=r"'x_no_shape:0' has no shape.*Give the "
                                                 r"placeholder a shape.*feeds=\["):
                fused.run(sess, {x: XS[0]})
            assert sess.run(w).tobytes() == before.tobytes()  # nothing applied
            # The run's feed dicts, one a step, are unambiguous: bitwise with single steps.
            got = fused.run(sess, feeds=[{x: XS[k]} for k in range(4)])[0]
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, name="x_no_shape")
        w = V1.get_variable("w", initializer=np.ones([3, 1], np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run([loss, train], {x: XS[k]})[0] for k in range(4)]
    assert got.tobytes() == np.array(want, np.float32).tobytes()


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_case04_a_fetched_variable_is_its_value_at_each_steps_end(mode):
    """The canonical loop fetches [loss, train_op, global_step] (and a counter's
    assign_add): each step's value is what that single step's sess.run returns, the
    value at the step's end. On main the resource read was unordered with the increment
    ([1, 1, 2] in one run) and a ref Variable gave one value a run in unrolled mode."""
    def program(ref):
        x, loss, train, gs = _dense_program(ref=ref)
        counter = V1.get_variable("counter", initializer=0, use_resource=not ref)
        with tf.control_dependencies([train]):
            bump = counter.assign_add(1)
        return x, [loss, bump, gs, counter]

    for ref in ([False, True] if mode == "unrolled" else [False]):
        with tf.Graph().as_default():
            x, fetches = program(ref)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                want = []
                for k in range(6):
                    loss, bump, _, _ = sess.run(fetches, {x: XS[k]})
                    # The fetched Variables' values at the step's end (the single step's
                    # own fetch of a resource variable is unordered with its increment).
                    want.append([loss, bump, *sess.run(fetches[2:])])
                want_vars = _globals(sess)
        with tf.Graph().as_default():
            x, fetches = program(ref)
            fused = ms.compile(fetches, steps=3, mode=mode)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                runs = [fused.run(sess, {x: XS[3 * r:3 * r + 3]}) for r in range(2)]
                got_vars = _globals(sess)
        for j in range(4):
            got = np.concatenate([np.asarray(run[j]).reshape(3) for run in runs])
            assert got.tolist() == [np.asarray(v[j]).item() for v in want], (ref, j)
        _same(got_vars, want_vars)


def test_case05_xla_over_random_ops_warns():
    """xla=True draws the shared stream's stateless op with XLA's own kernel, other bits
    than TensorFlow's: warned, naming the op. On main: no warning."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program(dropout="plain")
        with pytest.warns(RuntimeWarning, match=r"XLA-compiled steps draw random numbers "
                                                r"\(StatelessRandomUniformV2\)"):
            ms.compile([loss, train], steps=3, xla=True)


def _sum_program(shared=False):
    """tf.add_n([x, tanh(x @ a), sin(x @ b)]) (+ a shared input named to sort between
    the copies' names and the step's), x fed per step."""
    init = np.random.RandomState(7)
    x = V1.placeholder(tf.float32, [None, 3], "x")
    a = V1.get_variable("a", initializer=init.randn(3, 3).astype(np.float32))
    b = V1.get_variable("b", initializer=init.randn(3, 3).astype(np.float32))
    terms = [x, tf.tanh(x @ a), tf.sin(x @ b)]
    if shared:  # "b_shared" sorts after the step's "Sin" and "Tanh", before "multistep/..."
        terms.append(V1.placeholder_with_default(np.full([8, 3], 0.37, np.float32), [8, 3],
                                                 "b_shared"))
    loss = tf.reduce_mean(tf.square(tf.add_n(terms)))
    return x, loss, V1.train.GradientDescentOptimizer(0.1).minimize(loss)


SUMS = np.random.RandomState(6).randn(6, 8, 3).astype(np.float32)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_case06_a_sum_over_a_fed_input_is_bitwise_under_the_default_config(mode):
    """Grappler (TensorFlow's default session config) orders an AddN's inputs by name:
    each copy's per-step input is named as its placeholder within the copy, so the copy
    sums in the single step's order. On main the copies' inputs were `inputs/GatherV2`
    (`inputs/strided_slice`), which sort before `step/...`: 2.4e-7 apart in the losses
    (measured), both modes. The kernels each copy ran are the single step's too."""
    with tf.Graph().as_default():
        x, loss, train = _sum_program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            _, nodes = ms.kernels.executed(sess, [loss, train], {x: SUMS[0]})
            single = ms.kernels.by_name(nodes)
            want = [sess.run([loss, train], {x: d})[0] for d in SUMS[1:]]
            want_state = _globals(sess)
    with tf.Graph().as_default():
        x, loss, train = _sum_program()
        fused = ms.compile([loss, train], steps=3, mode=mode)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            _, nodes = ms.kernels.executed(sess, fused.values, fused.feed_dict({x: SUMS[:3]}))
            got = fused.run(sess, {x: SUMS[3:]})[0]
            state = _globals(sess)
    assert got.tobytes() == np.array(want[2:], np.float32).tobytes()
    _same(state, want_state)
    for step, copy in ms.kernels.of_copies(nodes, fused.name).items():
        assert copy == single, (step, set(copy.items()) ^ set(single.items()))


def test_case06_a_sum_with_a_value_from_outside_the_step_warns_with_the_fix():
    """Where the names cannot sort alike (a sum of the step's values and a shared input
    whose name falls between the copies' and the step's), the build says so, with the
    fix; under ms.session_config() the run is bitwise. On main: no warning, 2.4e-7 off."""
    with tf.Graph().as_default():
        x, loss, train = _sum_program(shared=True)
        with V1.Session(config=ms.session_config()) as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run([loss, train], {x: d})[0] for d in SUMS]
    with tf.Graph().as_default():
        x, loss, train = _sum_program(shared=True)
        with pytest.warns(RuntimeWarning, match=r"the sum 'AddN' .* 'b_shared' from outside"
                                                r".*config=ms.session_config\(\)"):
            fused = ms.compile([loss, train], steps=3, feeds=[x])
        with V1.Session(config=ms.session_config()) as sess:
            sess.run(V1.global_variables_initializer())
            got = np.concatenate([fused.run(sess, {x: SUMS[:3]})[0],
                                  fused.run(sess, {x: SUMS[3:]})[0]])
    assert got.tobytes() == np.array(want, np.float32).tobytes()


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_case07_a_fetched_shared_placeholder_or_constant_has_one_value_a_step(mode):
    """One structure in both modes: [N] values, as N sess.run calls return N values. On
    main unrolled mode gave one value a run."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        lr = V1.placeholder(tf.float32, [], "lr")
        fused = ms.compile([loss, train, lr, tf.constant(2.5)], steps=3, mode=mode, feeds=[x])
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            _, _, lrs, consts = fused.run(sess, {x: XS[:3], lr: 0.5})
    assert lrs.tolist() == [0.5] * 3 and consts.tolist() == [2.5] * 3


def test_case08_stop_at_step_sizes_the_last_run_by_the_steps_increment(tmp_path):
    """A step that advances the global step by 2: StopAtStepHook(last_step=10) stops at
    10, after 5 steps, as single steps run until the global step reaches 10 do. On main:
    runs of 4 and 2, global step 12."""
    def program():
        x, loss, train, gs = _dense_program()
        with tf.control_dependencies([train]):
            train = gs.assign_add(1).op  # a second increment a step
        return x, loss, train, gs

    with tf.Graph().as_default():
        # Single steps until the global step reaches last_step, as TensorFlow's hook means
        # to stop (the hook itself reads the global step unordered with a step's two
        # increments: under load it once stopped a step late, so it is no reference).
        x, loss, train, gs = program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want_steps = 0
            while sess.run(gs) < 10:
                sess.run(train, {x: XS[0]})
                want_steps += 1
    with tf.Graph().as_default():
        x, loss, train, gs = program()
        fused = ms.compile({"loss": loss, "train": train, "step": gs}, steps=4)
        assert fused.step_increment == 2
        with V1.train.MonitoredSession(hooks=[ms.hooks.StopAtStepHook(fused, last_step=10)]) as sess:
            runs = []
            while not sess.should_stop():
                runs.append(fused.run(sess, {x: XS[0]})["step"])  # one batch, every step
    assert [r.tolist() for r in runs] == [[2, 4, 6, 8], [10]] and want_steps == 5, runs


def test_case09_no_loss_fetched_means_no_losses():
    """[train, accuracy]: the accuracy is no loss (no gradient flows from it), so
    fused.losses is None and a hook that needs losses says so at construction (case 13).
    On main fused.losses was the accuracy, written under the tag 'loss'."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(x, 1), 0), tf.float32))
        fused = ms.compile([train, accuracy], steps=3)
        assert fused.losses is None
        assert ms.compile([train, accuracy, loss], steps=3).losses is not None


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def _running_out(check=False):
    """7 batches (x, 4 rows of 3); with ``check``, a check_numerics that fails at step 5
    (a log of 4 - the global step)."""
    data = tf.data.Dataset.from_tensor_slices(np.concatenate([XS, XS[:1]]))
    x = V1.data.make_one_shot_iterator(data).get_next()
    w = V1.get_variable("w", initializer=np.full([3, 2], 0.3, np.float32))
    gs = V1.train.get_or_create_global_step()
    h = tf.matmul(x, w)
    if check:
        h += 0.0 * tf.debugging.check_numerics(tf.math.log(4.0 - tf.cast(gs, tf.float32)),
                                               "step 5")
    loss = tf.reduce_mean(tf.square(h - 1.0))
    return {"loss": loss, "h": h, "train": V1.train.GradientDescentOptimizer(0.1).minimize(
        loss, global_step=gs)}


def _single_steps_until_error(fetches):
    with V1.Session() as sess:
        sess.run(V1.global_variables_initializer())
        values = []
        with pytest.raises((tf.errors.OutOfRangeError, tf.errors.InvalidArgumentError)):
            while True:
                values.append(sess.run(fetches))
        return values, _globals(sess)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_case10_an_input_that_runs_out_mid_run_says_how_many_steps_were_applied(mode):
    """7 batches, N = 3: the third run applies one step and runs out; the error is
    ms.InputExhaustedError (an OutOfRangeError) counting the steps applied and the
    global step, which the variables agree with; in loop mode it holds the applied
    step's values (``error.values``), bitwise with the single step's. On main:
    TensorFlow's raw OutOfRangeError, no count, step 7's values lost."""
    with tf.Graph().as_default():
        want, want_state = _single_steps_until_error(_running_out())
    with tf.Graph().as_default():
        fused = ms.compile(_running_out(), steps=3, mode=mode)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            fused.run(sess), fused.run(sess)
            with pytest.raises(ms.InputExhaustedError, match=r"the first 1 of its 3 steps were "
                                                             r"applied; the global step is now 7"
                               ) as raised:
                fused.run(sess)
            _same(_globals(sess), want_state)
    if mode == "unrolled":  # (the copies keep no values: the count only)
        assert raised.value.values is None
        return
    got = raised.value.values
    assert got["train"] is None and got["loss"].shape == (1,) and got["h"].shape == (1, 4, 2)
    assert got["loss"].tobytes() == np.float32(want[6]["loss"]).tobytes()
    assert got["h"][0].tobytes() == want[6]["h"].tobytes()


def test_case10_a_check_that_fails_mid_run_says_how_many_steps_were_applied():
    """A check_numerics that fails at step 5, runs of 3: single steps apply 4 steps and
    raise; the compiled program applies the same 4, raises ms.StepFailedError (an
    InvalidArgumentError, as TensorFlow's) with TensorFlow's message and
    "the first 1 of its 3 steps were applied", with step 4's values. On main: the raw
    error, no count, step 4's values lost."""
    with tf.Graph().as_default():
        want, want_state = _single_steps_until_error(_running_out(check=True))
    assert len(want) == 4
    with tf.Graph().as_default():
        fused = ms.compile(_running_out(check=True), steps=3)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            fused.run(sess)
            with pytest.raises(ms.StepFailedError,  # (an InvalidArgumentError)
                               match=r"(?s)step 5.*failed at its step 2: the first 1 of its 3 "
                                     r"steps were applied \(their values: this error's .values\)"
                               ) as raised:
                fused.run(sess)
            _same(_globals(sess), want_state)
    assert raised.value.values["loss"].tobytes() == np.float32(want[3]["loss"]).tobytes()


def test_case10_under_monitored_training_session_the_hook_has_the_applied_steps(tmp_path):
    """MonitoredTrainingSession ends cleanly on the input running out, as it does for
    single steps; ms.hooks.InputExhaustedHook says how many steps of the last run were
    applied and holds their values. On main: steps 1..6 reached the hooks, step 7's
    values were lost and nothing said so."""
    with tf.Graph().as_default():
        want, want_state = _single_steps_until_error(_running_out())
    with tf.Graph().as_default():
        fused = ms.compile(_running_out(), steps=3)
        exhausted, final = ms.hooks.InputExhaustedHook(fused), _FinalState()
        got = []
        with V1.train.MonitoredTrainingSession(hooks=[exhausted, final], save_checkpoint_secs=None,
                                               save_summaries_steps=None) as sess:
            while not sess.should_stop():
                got.append(fused.run(sess)["loss"])
    assert exhausted.steps_applied == 1
    losses = np.concatenate(got + [exhausted.values["loss"]])
    assert losses.tobytes() == np.array([w["loss"] for w in want], np.float32).tobytes()
    _same(final.state, want_state)


class _FinalState(V1.train.SessionRunHook):
    """The variables as the session ends (``end`` runs after the input ran out: the
    OutOfRangeError leaves the ``with`` block, which ends the session cleanly)."""

    def end(self, session):
        self.state = _globals(session)


def test_case11_a_local_variables_reset_keeps_the_run_length():
    """set_steps_per_run(2), then the per-epoch metric reset: runs stay 2 steps. On main
    the reset put them back to N."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        fused = ms.compile([loss, train], steps=3)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            fused.set_steps_per_run(sess, 2)
            sess.run(V1.local_variables_initializer())
            assert len(fused.run(sess, {x: XS[:2]})[0]) == 2


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_case12_a_fetch_whose_shape_varies_between_steps_is_one_array_a_step(mode):
    """batch(4) over 10 examples, 3 steps a run: the last batch has 2 rows, and a
    per-example fetch (argmax, the logits) changes shape. Each step's value is returned,
    as 3 sess.run calls return them (a list where the shapes differ), bitwise with single
    steps. On main all 3 steps were applied, then `Incompatible shapes during merge`
    (loop) / `Shapes of all inputs must match` (unrolled), and every value was lost."""
    data = np.random.RandomState(12).randn(10, 3).astype(np.float32)

    def program():
        dataset = tf.data.Dataset.from_tensor_slices(data).batch(4)
        x = V1.data.make_one_shot_iterator(dataset).get_next()
        w = V1.get_variable("w", initializer=np.full([3, 2], 0.3, np.float32))
        logits = x @ w
        loss = tf.reduce_mean(tf.square(logits - 1.0))
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return [loss, tf.argmax(logits, 1), logits, train]

    with tf.Graph().as_default():
        fetches = program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run(fetches) for _ in range(3)]
            want_state = _globals(sess)
    with tf.Graph().as_default():
        fused = ms.compile(program(), steps=3, mode=mode)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            losses, predicted, logits, _ = fused.run(sess)
            state = _globals(sess)
    assert losses.tobytes() == np.array([w[0] for w in want], np.float32).tobytes()
    assert isinstance(predicted, list) and [p.shape for p in predicted] == [(4,), (4,), (2,)]
    for k in range(3):
        assert predicted[k].tobytes() == want[k][1].tobytes()
        assert logits[k].tobytes() == want[k][2].tobytes()
    _same(state, want_state)


def test_case13_hooks_on_a_program_without_a_loss_say_what_to_fetch():
    """A GAN's {"d_loss", "g_loss", "train"}: refused at construction with the fix. On
    main: TypeError "Argument 'fetch' = None" at the first run."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        fused = ms.compile({"d_loss": loss, "g_loss": 2 * loss, "train": train}, steps=3)
        with pytest.raises(ValueError, match=r"fetches no loss.*under the key 'loss'"):
            ms.hooks.StopAtStepHook(fused, last_step=6)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_case14_a_sparse_placeholder_is_fed_as_session_run_feeds_it(mode):
    """A sparse_placeholder fed a SparseTensorValue: the same sparse batch every step,
    bitwise with single steps. On main: "You must feed a value for placeholder tensor
    'multistep/inputs/bow_indices'"."""
    value = V1.SparseTensorValue([[0, 1], [2, 0], [3, 2]], np.float32([1, 2, 3]), [4, 3])

    def program():
        bow = V1.sparse_placeholder(tf.float32, [None, 3], name="bow")
        w = V1.get_variable("w", initializer=np.full([3, 1], 0.2, np.float32))
        loss = tf.reduce_mean(tf.square(tf.sparse.sparse_dense_matmul(bow, w) - 1.0))
        return bow, [loss, V1.train.GradientDescentOptimizer(0.1).minimize(loss)]

    with tf.Graph().as_default():
        bow, fetches = program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run(fetches, {bow: value})[0] for _ in range(3)]
    with tf.Graph().as_default():
        bow, fetches = program()
        fused = ms.compile(fetches, steps=3, mode=mode)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            got = fused.run(sess, {bow: value})[0]
    assert got.tobytes() == np.array(want, np.float32).tobytes()


def test_case15_ref_variables_under_xla_or_a_v2_loop_are_refused_by_name():
    """Ref variables: refused at build, naming the variable and the fix. On main: a raw
    "float ... incompatible with expected float_ref"."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program(ref=True)
        with pytest.raises(ValueError, match=r"ref variable\(s\) 'w'.*XLA.*use_resource=True"):
            ms.compile([loss, train], steps=3, xla=True)
        with pytest.raises(ValueError, match=r"ref variable\(s\) 'w'.*v2 control flow.*"
                                             r"mode='unrolled'"):
            ms.compile([loss, train], steps=3)


def test_case16_more_loop_steps_than_int32_counts_are_refused_by_name():
    """On main: a raw tf.cond TypeError."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        with pytest.raises(ValueError, match=r"steps=2147483648 is more than a loop can count"):
            ms.compile([loss, train], steps=2 ** 31)


def test_case17_an_unrolled_graph_over_2_gib_is_refused_before_it_is_built():
    """A 64 MiB constant in the step, N = 34: refused at once, naming loop mode. On main:
    "Invalid GraphDef" after 40 s."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        big = tf.constant(np.zeros([16 * 2 ** 20], np.float32))  # 64 MiB
        loss2 = loss + tf.reduce_sum(big) * 0.0
        with pytest.raises(ms.GraphTooLargeError, match=r"2 GiB limit. Use mode='while_loop'"):
            ms.compile([loss2, train], steps=34, mode="unrolled")


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_case19_a_fetched_indexed_slices_has_its_components_per_step(mode):
    """An embedding's gradient (IndexedSlices) fetched, as sess.run accepts it: each
    component one value a step, bitwise with single steps. On main: refused as "not an
    op or a tensor"."""
    ids = np.array([[0, 2], [1, 1], [3, 0]], np.int32)

    def program():
        i = V1.placeholder(tf.int32, [2], "ids")
        table = V1.get_variable("table", initializer=np.full([4, 2], 0.5, np.float32))
        loss = tf.reduce_sum(tf.square(tf.gather(table, i)))
        grad = tf.gradients(loss, table)[0]
        return i, [loss, grad, V1.train.GradientDescentOptimizer(0.1).minimize(loss)]

    with tf.Graph().as_default():
        i, fetches = program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run(fetches, {i: ids[k]})[1] for k in range(3)]
    with tf.Graph().as_default():
        i, fetches = program()
        assert isinstance(fetches[1], tf.IndexedSlices)
        fused = ms.compile(fetches, steps=3, mode=mode)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            got = fused.run(sess, {i: ids})[1]
    assert got.values.tobytes() == np.stack([w.values for w in want]).tobytes()
    assert got.indices.tolist() == [w.indices.tolist() for w in want]


def test_case20_compiling_in_a_finalized_graph_says_to_compile_first():
    """Inside MonitoredTrainingSession the graph is finalized. On main: TensorFlow's
    "Graph is finalized and cannot be modified"."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        with V1.train.MonitoredSession():
            with pytest.raises(RuntimeError, match=r"finalized.*Call ms.compile before "
                                                   r"creating the session"):
                ms.compile([loss, train], steps=3)


def test_case21_the_programs_own_feed_with_the_compiled_train_op_says_how_to_feed():
    """sess.run(fused.train_op, {x: batch}), as a loop that swaps only the fetch: the
    error names fused.run and fused.feed_dict, and nothing is applied. On main: "You
    must feed a value for placeholder tensor 'multistep/inputs/x'"."""
    with tf.Graph().as_default():
        x, loss, train, _ = _dense_program()
        fused = ms.compile([loss, train], steps=3)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            before = _globals(sess)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"x:0.*fused.run\(sess, feed_dict\)"):
                sess.run(fused.train_op, {x: XS[0]})
            _same(_globals(sess), before)
            sess.run(fused.train_op, fused.feed_dict({x: XS[:3]}))  # the fix runs


def test_case15_and_04_under_disable_v2_behavior():
    """Under disable_v2_behavior() (ref variables, v1 control flow), in a subprocess:
    ref fetches in loop mode are each step's own value ([1, 2, 3], was [3, 3, 3]), and
    xla=True refuses the ref variables by name."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf, multistep as ms
        V1 = tf.compat.v1
        V1.disable_v2_behavior()
        def program():
            x = V1.placeholder(tf.float32, [None, 3], "x")
            w = V1.get_variable("w", initializer=np.full([3, 2], 0.3, np.float32))
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
            gs = V1.train.get_or_create_global_step()
            train = V1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=gs)
            counter = V1.get_variable("counter", initializer=0)
            with tf.control_dependencies([train]):
                bump = counter.assign_add(1)
            return x, [loss, bump, gs]
        xs = np.random.RandomState(0).randn(6, 4, 3).astype(np.float32)
        with tf.Graph().as_default():
            x, fetches = program()
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                want = [sess.run(fetches, {x: xs[k]}) for k in range(6)]
        with tf.Graph().as_default():
            x, fetches = program()
            fused = ms.compile(fetches, steps=3)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                got = [fused.run(sess, {x: xs[3 * r:3 * r + 3]}) for r in range(2)]
            try:
                ms.compile(fetches, steps=3, xla=True, name="xla")
                print("XLA: built")
            except ValueError as error:
                print("XLA:", error)
        for j in range(3):
            a = np.concatenate([np.asarray(r[j]).reshape(-1) for r in got])
            b = np.array([np.asarray(v[j]).item() for v in want], a.dtype)
            print("FETCH", j, a.tobytes() == b.tobytes(), a.tolist())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [l.split()[2] for l in lines if l.startswith("FETCH")] == ["True"] * 3, lines
    assert "FETCH 1 True [1, 2, 3, 4, 5, 6]" in lines, lines
    xla = next(l for l in lines if l.startswith("XLA:"))
    assert "ref variable(s) 'counter', 'global_step', 'w'" in xla and "use_resource=True" in xla
