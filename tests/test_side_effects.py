"""Everything a single step runs, each inner step runs: update ops, after_apply, and no
stateful op left dangling. References are single steps written in the canonical TF1 way:
``with tf.control_dependencies(UPDATE_OPS): train = opt.minimize(loss)`` and
``with tf.control_dependencies([train]): ema.apply(...)``; every global variable
(weights, slots, moving statistics, EMA shadows, global step) is compared bitwise."""

import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
UPDATE_OPS = V1.GraphKeys.UPDATE_OPS
rng = np.random.RandomState(7)
X = rng.randn(6, 8, 3).astype(np.float32)   # 6 batches: one per step of the longest run
Y = rng.randn(6, 8, 2).astype(np.float32)
OPTIMIZERS = {
    "GradientDescent": lambda: V1.train.GradientDescentOptimizer(0.1),
    "Momentum": lambda: V1.train.MomentumOptimizer(0.1, 0.9),
    "Adam": lambda: V1.train.AdamOptimizer(0.05),
}


def bn_loss(x, y, use_resource=True):
    """Dense 3->2 with a hand-written batch norm: its moving mean and variance are updated by
    ops in UPDATE_OPS, as tf.compat.v1.layers.batch_normalization adds them."""
    w = V1.get_variable("dense/kernel", initializer=rng_init((3, 2)), use_resource=use_resource)
    mean_var = V1.get_variable("bn/moving_mean", initializer=np.zeros(2, np.float32),
                               trainable=False, use_resource=use_resource)
    var_var = V1.get_variable("bn/moving_variance", initializer=np.ones(2, np.float32),
                              trainable=False, use_resource=use_resource)
    h = tf.matmul(x, w)
    mean, variance = tf.nn.moments(h, [0])
    V1.add_to_collection(UPDATE_OPS, V1.assign(mean_var, 0.9 * mean_var + 0.1 * mean))
    V1.add_to_collection(UPDATE_OPS, V1.assign(var_var, 0.9 * var_var + 0.1 * variance))
    return tf.reduce_mean(tf.square((h - mean) * tf.math.rsqrt(variance + 1e-3) - y))


def rng_init(shape):
    return np.random.RandomState(1).randn(*shape).astype(np.float32)


def values():
    return {v.op.name: V1.get_default_session().run(v) for v in V1.global_variables()}


def single_steps(loss_fn, optimizer, steps, after_apply=None, **kw):
    """``steps`` canonical single steps, one sess.run each, batch k in step k."""
    with tf.Graph().as_default():
        x, y = V1.placeholder(tf.float32, [8, 3]), V1.placeholder(tf.float32, [8, 2])
        gs = V1.train.get_or_create_global_step()
        loss = loss_fn(x, y, **kw)
        with tf.control_dependencies(V1.get_collection(UPDATE_OPS)):
            train = optimizer().minimize(loss, global_step=gs)
        if after_apply is not None:
            with tf.control_dependencies([train]):
                train = tf.group(after_apply())
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for k in range(steps):
                sess.run(train, {x: X[k], y: Y[k]})
            return values()


def fused_steps(loss_fn, optimizer, steps, runs, *, mode="unrolled", after_apply=None, kw=None,
                **options):
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        xs, ys = V1.placeholder(tf.float32, [steps, 8, 3]), V1.placeholder(tf.float32, [steps, 8, 2])
        unrolled = ms.unroll(lambda x, y: loss_fn(x, y, **(kw or {})), optimizer(), steps,
                             inputs=(xs, ys), global_step=gs, mode=mode,
                             after_apply=after_apply, **options)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for r in range(runs):
                sess.run(unrolled.train_op, {xs: X[r * steps:(r + 1) * steps],
                                             ys: Y[r * steps:(r + 1) * steps]})
            return values(), V1.get_collection(UPDATE_OPS)


def assert_bitwise(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), f"{name}: {got[name]} != {want[name]}"


CASES = [(n, mode, opt) for n in (1, 2, 5) for mode in ("unrolled", "while_loop") for opt in OPTIMIZERS]


@pytest.mark.parametrize("steps,mode,optimizer", CASES)
def test_update_ops_run_in_every_step(steps, mode, optimizer):
    runs = 6 // steps if steps != 5 else 1
    want = single_steps(bn_loss, OPTIMIZERS[optimizer], steps * runs)
    got, collection = fused_steps(bn_loss, OPTIMIZERS[optimizer], steps, runs, mode=mode)
    assert_bitwise(got, want)
    assert not np.array_equal(got["bn/moving_mean"], np.zeros(2, np.float32))
    # The collection holds one step's update ops, as the single-step graph's does.
    assert len(collection) == 2 and all(op.name.startswith("multistep/step/forward/")
                                        for op in collection)  # the single step the copies copy


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_update_ops_with_ref_variables(optimizer):
    want = single_steps(bn_loss, OPTIMIZERS[optimizer], 6, use_resource=False)
    got, _ = fused_steps(bn_loss, OPTIMIZERS[optimizer], 3, 2, kw={"use_resource": False})
    assert_bitwise(got, want)


def test_update_ops_false_leaves_them_out_and_verify_reports_it():
    got, _ = fused_steps(bn_loss, OPTIMIZERS["GradientDescent"], 3, 1, update_ops=False)
    assert got["bn/moving_mean"].tobytes() == np.zeros(2, np.float32).tobytes()

    def build(steps):  # fused without the update ops, single with them; one fixed batch
        return ms.unroll(lambda: bn_loss(X[0], Y[0]), V1.train.GradientDescentOptimizer(0.1),
                         steps, update_ops=steps == 1), {}

    report = ms.verify(build, steps=3, runs=1)
    assert not report.ok and report.per_variable["bn/moving_mean"] > 0
    assert report.per_variable["dense/kernel"] == 0  # batch statistics train the weights alike


def ema_loss(x, y):
    w = V1.get_variable("w", initializer=rng_init((3, 2)))
    return tf.reduce_mean(tf.square(tf.matmul(x, w) - y))


def make_ema_after_apply():
    ema = V1.train.ExponentialMovingAverage(0.5)
    return lambda: ema.apply(V1.trainable_variables())


def max_norm_after_apply():
    [w] = V1.trainable_variables()
    return V1.assign(w, tf.clip_by_norm(w, 1.0, axes=[0]))


@pytest.mark.parametrize("steps,mode,optimizer", CASES)
def test_ema_after_apply_updates_once_per_step(steps, mode, optimizer):
    runs = 6 // steps if steps != 5 else 1
    want = single_steps(ema_loss, OPTIMIZERS[optimizer], steps * runs, make_ema_after_apply())
    got, _ = fused_steps(ema_loss, OPTIMIZERS[optimizer], steps, runs, mode=mode,
                         after_apply=make_ema_after_apply())
    assert "w/ExponentialMovingAverage" in got  # the shadow has its single-step name
    assert_bitwise(got, want)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_projection_after_apply(mode):
    want = single_steps(ema_loss, OPTIMIZERS["Adam"], 6, max_norm_after_apply)
    got, _ = fused_steps(ema_loss, OPTIMIZERS["Adam"], 3, 2, mode=mode, after_apply=max_norm_after_apply)
    assert_bitwise(got, want)
    assert np.all(np.linalg.norm(got["w"], axis=0) <= 1.0 + 1e-6)  # one float32 rounding of 1.0


def test_after_apply_with_a_rule_optimizer_and_skipped_steps():
    # A non-finite step is skipped: its weights stay and it runs no after_apply, so the
    # EMA moves in the finite steps only. Reference: single steps that run the EMA only
    # when the step was finite (the non-finite batch is batch 1).
    xs = X.copy()
    xs[1, 0, 0] = np.inf
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, [8, 3])
        y = V1.placeholder(tf.float32, [8, 2])
        loss = ema_loss(x, y)
        opt = ms.RuleOptimizer(ms.rules.sgd(), learning_rate=0.1)
        train = opt.minimize(loss)
        with tf.control_dependencies([train]):
            train = tf.group(make_ema_after_apply()())
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for k in (0, 2):
                sess.run(train, {x: xs[k], y: Y[k]})
            want = values()
    with tf.Graph().as_default():
        unrolled = ms.unroll(ema_loss, ms.RuleOptimizer(ms.rules.sgd(), learning_rate=0.1), 3,
                             inputs=(tf.constant(xs[:3]), tf.constant(Y[:3])), nonfinite="skip",
                             after_apply=make_ema_after_apply())
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(unrolled.train_op)
            assert sess.run(unrolled.skipped_steps) == 1
            got = {k: v for k, v in values().items() if k != "multistep/skipped_steps"}
    assert_bitwise(got, want)


def test_mod_b_reassignment_after_a_stock_optimizer():
    # Seed thread 001: the regular optimizer step, then the weights taken mod B.
    def after():
        [w] = V1.trainable_variables()
        return V1.assign(w, tf.math.floormod(w, 0.5))

    want = single_steps(ema_loss, OPTIMIZERS["Momentum"], 6, after)
    got, _ = fused_steps(ema_loss, OPTIMIZERS["Momentum"], 3, 2, after_apply=after)
    assert_bitwise(got, want)
    assert np.all((got["w"] >= 0) & (got["w"] < 0.5))


def test_a_dangling_counter_is_refused_by_name():
    def loss_fn():
        w = V1.get_variable("w", initializer=1.0)
        counter = V1.get_variable("calls", initializer=0, trainable=False)
        counter.assign_add(1, name="count_calls")  # nothing depends on it
        return w * w

    with tf.Graph().as_default(), pytest.raises(ValueError, match=r"count_calls.*never run") as info:
        ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 3)
    assert "UPDATE_OPS" in str(info.value) and "after_apply" in str(info.value)


def test_a_dangling_op_is_located_in_the_users_code():
    """TensorFlow drops ``name=`` of assign_add on a resource variable (the op is
    'AssignAddVariableOp'): the error names the file and line that built it."""
    def loss_fn():
        w = V1.get_variable("w", initializer=1.0)
        counter = V1.get_variable("calls", initializer=0.0, trainable=False)
        V1.assign_add(counter, 1.0, name="count_calls")  # the line the error must name
        return w * w

    line = loss_fn.__code__.co_firstlineno + 3
    with tf.Graph().as_default(), pytest.raises(ValueError) as info:
        ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 3)
    assert "'multistep/step/forward/AssignAddVariableOp'" in str(info.value)  # the single step's
    assert f"at {__file__}:{line} (in loss_fn)" in str(info.value), str(info.value)


def test_an_after_apply_op_it_does_not_return_is_refused():
    def after():
        [w] = V1.trainable_variables()
        V1.assign(w, w * 0.5, name="forgotten")
        return None

    with tf.Graph().as_default(), pytest.raises(ValueError, match="forgotten"):
        ms.unroll(lambda: V1.get_variable("w", initializer=1.0) ** 2,
                  V1.train.GradientDescentOptimizer(0.1), 2, after_apply=after)


def test_a_print_nothing_depends_on_is_refused():
    def loss_fn():
        w = V1.get_variable("w", initializer=1.0)
        tf.print("loss", w, name="lost_print")
        return w * w

    with tf.Graph().as_default(), pytest.raises(ValueError, match="lost_print"):
        ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 2)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_state_a_step_writes_is_watched_by_the_stale_forward_check(mode):
    # loss_avg is written by every step (an update op) and read once, outside loss_fn: every
    # step after the first would use the value from before the run.
    with tf.Graph().as_default():
        loss_avg = V1.get_variable("loss_avg", initializer=1.0, trainable=False)
        norm = tf.maximum(loss_avg.read_value(), 1e-3)

        def loss_fn():
            w = V1.get_variable("w", initializer=2.0)
            loss = w * w / norm
            V1.add_to_collection(UPDATE_OPS, loss_avg.assign(0.9 * loss_avg + 0.1 * loss))
            return loss

        with pytest.raises(ms.StaleForwardError, match="loss_avg"):
            ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 3, mode=mode)


@pytest.mark.parametrize("bad,error", [("yes", ValueError), (1, ValueError), (None, ValueError)])
def test_bad_update_ops(bad, error):
    with tf.Graph().as_default(), pytest.raises(error, match="update_ops"):
        ms.unroll(lambda: V1.get_variable("w", initializer=1.0) ** 2,
                  V1.train.GradientDescentOptimizer(0.1), 2, update_ops=bad)


def test_after_apply_must_be_callable_and_return_ops():
    loss = lambda: V1.get_variable("w", initializer=1.0) ** 2  # noqa: E731
    with tf.Graph().as_default(), pytest.raises(TypeError, match="after_apply"):
        ms.unroll(loss, V1.train.GradientDescentOptimizer(0.1), 2, after_apply=V1.no_op())
    with tf.Graph().as_default(), pytest.raises(TypeError, match="after_apply must return"):
        ms.unroll(loss, V1.train.GradientDescentOptimizer(0.1), 2, after_apply=lambda: 3.0)


def test_update_ops_built_outside_loss_fn_are_warned_about():
    """A single step under control_dependencies(UPDATE_OPS) runs a counter added to the
    collection before the model (48 times in 48 steps); ms.unroll runs only what loss_fn
    adds (0 times): it says so at build, naming the op and where it was built."""
    with tf.Graph().as_default():
        counter = V1.get_variable("counter", initializer=0, trainable=False)
        V1.add_to_collection(UPDATE_OPS, counter.assign_add(1, name="count_steps"))
        line = sys._getframe().f_lineno - 1
        with pytest.warns(RuntimeWarning, match=r"UPDATE_OPS holds 1 op\(s\) built outside "
                          r"loss_fn: 'count_steps'") as caught:
            ms.unroll(lambda: V1.get_variable("w", initializer=1.0) ** 2,
                      V1.train.GradientDescentOptimizer(0.1), 3)
        assert f"at {__file__}:{line}" in str(caught[0].message)
        # A second model in the same graph: the first's update ops (built by its
        # loss_fn) are not "outside"; the counter still is.
        with pytest.warns(RuntimeWarning, match="holds 1 op"):
            ms.unroll(lambda x, y: bn_loss(x, y), V1.train.GradientDescentOptimizer(0.1), 2,
                      inputs=(tf.constant(X[:2]), tf.constant(Y[:2])), name="second")
        V1.get_collection_ref(UPDATE_OPS).pop(0)

        def third(x, y):
            with V1.variable_scope("third"):
                return bn_loss(x, y)

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ms.unroll(third, V1.train.GradientDescentOptimizer(0.1), 2,
                      inputs=(tf.constant(X[:2]), tf.constant(Y[:2])), name="third")


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_a_counter_written_after_apply_and_read_in_a_cond_reads_this_runs_value(mode):
    """A cond on a fed `training` switch whose branch reads a counter that after_apply
    increments: each step must read the count after the previous step's after_apply
    (a lowered cond's reads used to wait for the switch only: every step read the count
    from before the run). Reference: canonical single steps."""
    def model(x, y):
        w = V1.get_variable("dense/kernel", initializer=rng_init((3, 2)))
        count = V1.get_variable("count", initializer=0.0, trainable=False)
        training = V1.get_default_graph().get_tensor_by_name("training:0")
        h = tf.matmul(x, w)  # an input of the cond built in the step (its only order, once)
        h = tf.cond(training, lambda: h / (1.0 + count.read_value()), lambda: h)
        return tf.reduce_mean(tf.square(h - y))

    def after_apply():
        [count] = [v for v in V1.global_variables() if v.op.name == "count"]
        return count.assign_add(1.0)

    def with_switch(fn):
        def build(*args, **kw):
            graph = V1.get_default_graph()
            if not graph.get_operations() or "training" not in [op.name for op in graph.get_operations()]:
                with graph.name_scope(None):
                    V1.placeholder_with_default(True, [], name="training")
            return fn(*args, **kw)
        return build

    want = single_steps(with_switch(model), OPTIMIZERS["GradientDescent"], 6, after_apply=after_apply)
    got, _ = fused_steps(with_switch(model), OPTIMIZERS["GradientDescent"], 3, 2, mode=mode,
                         after_apply=after_apply)
    assert want["count"] == 6.0
    assert_bitwise(got, want)


def cifar_losses(x, y):
    """The CIFAR-10 tutorial's idiom: weight decay and the data loss added to the 'losses'
    collection, the loss their sum over the collection."""
    w = V1.get_variable("dense/kernel", initializer=rng_init((3, 2)))
    V1.add_to_collection("losses", tf.multiply(tf.nn.l2_loss(w), 0.004, name="weight_loss"))
    V1.add_to_collection("losses", tf.reduce_mean(tf.square(tf.matmul(x, w) - y), name="data"))
    return tf.add_n(V1.get_collection("losses"), name="total_loss")


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_terms_added_to_a_collection_are_each_steps_own(mode):
    """Step k's tf.get_collection('losses') holds step k's terms (it used to hold step 1's
    too: refused as a stale forward pass 'built outside loss_fn'), bitwise with canonical
    single steps; the collection keeps one step's terms, as a single-step graph's."""
    want = single_steps(cifar_losses, OPTIMIZERS["Momentum"], 6)
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        xs, ys = V1.placeholder(tf.float32, [3, 8, 3]), V1.placeholder(tf.float32, [3, 8, 2])
        unrolled = ms.unroll(cifar_losses, OPTIMIZERS["Momentum"](), 3, inputs=(xs, ys),
                             global_step=gs, mode=mode)
        assert [t.op.name for t in V1.get_collection("losses")] == [  # the single step's
            "multistep/step/forward/weight_loss", "multistep/step/forward/data"]
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for r in range(2):
                sess.run(unrolled.train_op, {xs: X[3 * r:3 * r + 3], ys: Y[3 * r:3 * r + 3]})
            assert_bitwise(values(), want)


def fused_and_single(build, steps=3):
    """``build(fused)`` makes the program in a new graph and returns its train op: an
    ``ms.unroll``'s of ``steps`` steps, or the program's own single step. Returns the
    global variables by name after one fused run, and after ``steps`` single runs."""
    out = []
    for fused in (True, False):
        with tf.Graph().as_default(), V1.Session() as sess:
            train = build(fused)
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            for _ in range(1 if fused else steps):
                sess.run(train)
            out.append(values())
    return out


def test_a_term_made_once_in_a_collection_is_each_steps_own():
    """A layer's kernel_regularizer makes its penalty once, when it creates the kernel
    (into 'regularization_losses'), and get_regularization_loss() reads it: the single
    step holds it, so every step computes it from its own weights (it was refused when
    each step called loss_fn again, and the later calls made no penalty)."""
    def build(fused):
        built = []

        def loss_fn():
            w = V1.get_variable("w", initializer=rng_init((3, 2)))
            if not built:  # as a tf.compat.v1.layers layer builds its kernel and penalty, once
                built.append(w)
                V1.add_to_collection(V1.GraphKeys.REGULARIZATION_LOSSES,
                                     0.01 * tf.reduce_sum(tf.square(w)))
            return tf.reduce_sum(tf.square(w - 1.0)) + V1.losses.get_regularization_loss()

        opt = V1.train.GradientDescentOptimizer(0.1)
        return ms.unroll(loss_fn, opt, 3).train_op if fused else opt.minimize(loss_fn())

    got, want = fused_and_single(build)
    assert_bitwise(got, want)


def test_a_stale_tensor_from_a_collection_is_named_with_it():
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=rng_init((3, 2)))
        V1.add_to_collection("penalties", tf.reduce_sum(tf.square(w), name="made_once"))
        with pytest.raises(ms.StaleForwardError, match=(
                r"'made_once'.*came through the graph collection 'penalties'")):
            ms.unroll(lambda: tf.reduce_sum(w) + tf.add_n(V1.get_collection("penalties")),
                      V1.train.GradientDescentOptimizer(0.1), 3)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_get_variables_regularizer_is_each_steps_own(mode):
    """get_variable(regularizer=) puts a lazily evaluated term in 'regularization_losses':
    each use makes its ops anew, so get_regularization_loss() in step k reads step k's
    weights; bitwise with canonical single steps."""
    def loss_fn(x, y):
        w = V1.get_variable("dense/kernel", initializer=rng_init((3, 2)),
                            regularizer=lambda v: 0.01 * tf.reduce_sum(tf.square(v)))
        return tf.reduce_mean(tf.square(tf.matmul(x, w) - y)) + V1.losses.get_regularization_loss()

    want = single_steps(loss_fn, OPTIMIZERS["Adam"], 6)
    got, _ = fused_steps(loss_fn, OPTIMIZERS["Adam"], 3, 2, mode=mode)
    assert_bitwise(got, want)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_tf_compat_v1_metrics_in_loss_fn_accumulate_over_every_step(mode):
    """A metric in loss_fn was refused: each step called loss_fn anew and made new
    accumulators. Built once with the single step, its update op in UPDATE_OPS runs at
    every step: total, count and the metric bitwise with single steps that fetch the
    update op beside the train op. Left out of UPDATE_OPS, the update op would never run:
    refused by name."""
    def model(collect):
        w = V1.get_variable("w", initializer=1.0)
        loss = w * w
        mean, update = V1.metrics.mean(loss)
        if collect:
            V1.add_to_collection(V1.GraphKeys.UPDATE_OPS, update)
        return loss, mean, update

    with tf.Graph().as_default():
        loss, mean, update = model(False)
        train = V1.train.GradientDescentOptimizer(0.25).minimize(loss)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            for _ in range(6):
                sess.run([train, update])
            want = {v.op.name: sess.run(v) for v in V1.global_variables() + V1.local_variables()}
            want_mean = sess.run(mean)
    with tf.Graph().as_default():
        means = []
        unrolled = ms.unroll(lambda: (lambda out: means.append(out[1]) or out[0])(model(True)),
                             V1.train.GradientDescentOptimizer(0.25), 3, mode=mode)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            for _ in range(2):
                sess.run(unrolled.train_op)
            got = {v.op.name: sess.run(v) for v in V1.global_variables() + V1.local_variables()}
            got_mean = sess.run(means[0])
    assert {"mean/total", "mean/count", "w"} <= set(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    assert got_mean == want_mean == np.float32(sum(0.5 ** (2 * k) for k in range(6)) / 6)
    with tf.Graph().as_default(), pytest.raises(ValueError, match=r"mean/AssignAddVariableOp.*"
                                                                  r"never run.*UPDATE_OPS"):
        ms.unroll(lambda: model(False)[0], V1.train.GradientDescentOptimizer(0.25), 3)


@pytest.mark.parametrize("ema_name", ["ExponentialMovingAverage", "avg"])
def test_an_ema_of_a_tensor_in_after_apply_moves_at_every_step(ema_name):
    """An EMA of the loss after each apply (the CIFAR-10 tutorial's EMA is named "avg"):
    its shadow is made once, with the single step, and every step moves it, bitwise with
    the single step ``with control_dependencies([train]): ema.apply([loss])`` (it was
    refused when each step called loss_fn again: the shadow's name followed the tensor)."""
    def build(fused):
        w = V1.get_variable("w", initializer=1.0)
        ema = V1.train.ExponentialMovingAverage(0.9, name=ema_name)
        opt = V1.train.GradientDescentOptimizer(0.1)
        last = []

        def loss_fn():
            last[:] = [w * w]
            return last[0]

        if fused:
            return ms.unroll(loss_fn, opt, 3, after_apply=lambda: ema.apply(last)).train_op
        train = opt.minimize(loss_fn())
        with tf.control_dependencies([train]):
            return ema.apply(last)

    got, want = fused_and_single(build)
    assert_bitwise(got, want)
    assert len(want) == 2  # w and the loss's shadow


def test_an_after_apply_op_not_returned_is_refused_saying_return_it():
    def after():
        [w] = V1.trainable_variables()
        w.assign(w * 0.5)
        return None

    with tf.Graph().as_default(), pytest.raises(ValueError, match=r"after_apply builds .*does not return it.*Return it"):
        ms.unroll(lambda: V1.get_variable("w", initializer=1.0) ** 2,
                  V1.train.GradientDescentOptimizer(0.1), 2, after_apply=after)


@pytest.mark.parametrize("ema_name", ["ExponentialMovingAverage", "avg"])
def test_an_ema_of_the_loss_in_loss_fn_moves_at_every_step(ema_name):
    """The CIFAR-10 tutorial's ema.apply([losses]) in the model, in UPDATE_OPS: bitwise
    with the single step under control_dependencies(UPDATE_OPS) (it was refused when each
    step called loss_fn again: at step 2 the shadow's name, after step 2's tensor, was new)."""
    def build(fused):
        ema = V1.train.ExponentialMovingAverage(0.9, name=ema_name)

        def loss_fn():
            w = V1.get_variable("w", initializer=1.0)
            loss = w * w
            V1.add_to_collection(UPDATE_OPS, ema.apply([loss]))
            return loss

        opt = V1.train.GradientDescentOptimizer(0.1)
        if fused:
            return ms.unroll(loss_fn, opt, 3).train_op
        loss = loss_fn()
        with tf.control_dependencies(V1.get_collection(UPDATE_OPS)):
            return opt.minimize(loss)

    got, want = fused_and_single(build)
    assert_bitwise(got, want)
    assert len(want) == 2  # w and the loss's shadow
