"""ms.unroll against an independent reference: N plain sess.run(opt.minimize(...)) calls.

The reference graphs here are written without multistep. Both sides start from
the same constant initial values, so no value is copied between them; every
global variable (weights, slots, global step) is compared by name after every
fused run, and the comparison is bitwise.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
OPTIMIZERS = {
    "GradientDescent": lambda: V1.train.GradientDescentOptimizer(0.1),
    "Momentum": lambda: V1.train.MomentumOptimizer(0.1, 0.9),
    "Nesterov": lambda: V1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
    "Adam": lambda: V1.train.AdamOptimizer(0.05),
    "RMSProp": lambda: V1.train.RMSPropOptimizer(0.05, momentum=0.5),
    "RMSPropCentered": lambda: V1.train.RMSPropOptimizer(0.05, centered=True),
    "Adagrad": lambda: V1.train.AdagradOptimizer(0.1),
    "Adadelta": lambda: V1.train.AdadeltaOptimizer(1.0),
    "Ftrl": lambda: V1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.01),
    "ProximalAdagrad": lambda: V1.train.ProximalAdagradOptimizer(0.1, l2_regularization_strength=0.01),
    "ProximalGradientDescent": lambda: V1.train.ProximalGradientDescentOptimizer(0.1, l1_regularization_strength=0.01),
}
RUNS = 3
BATCH = 8
_rng = np.random.RandomState(0)
INIT = {
    "layer1/w": _rng.randn(3, 4).astype(np.float32),
    "layer1/b": _rng.randn(4).astype(np.float32) * 0.1,
    "layer2/w": _rng.randn(4, 2).astype(np.float32),
    "layer2/b": np.zeros(2, np.float32),
}
DATA_X = _rng.randn(17 * RUNS, BATCH, 3).astype(np.float32)  # one batch per global step
DATA_Y = _rng.randint(0, 2, size=(17 * RUNS, BATCH)).astype(np.int32)


def mlp_loss(x, y, use_resource):
    def var(name):
        return V1.get_variable(name, initializer=INIT[name], use_resource=use_resource)

    h = tf.tanh(tf.matmul(x, var("layer1/w")) + var("layer1/b"))
    logits = tf.matmul(h, var("layer2/w")) + var("layer2/b")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def all_values(sess):
    return {v.op.name: sess.run(v) for v in V1.global_variables()}


def run_reference(build_loss, make_optimizer, steps, runs, *, per_step=False, learning_rate=None):
    """N*runs plain minimize steps; snapshots of every variable after each N of them."""
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        if per_step:
            x = V1.placeholder(tf.float32, [BATCH, 3])
            y = V1.placeholder(tf.int32, [BATCH])
            feeds = [{x: DATA_X[j], y: DATA_Y[j]} for j in range(steps * runs)]
        else:
            x, y = DATA_X[0], DATA_Y[0]
            feeds = [{}] * (steps * runs)
        loss = build_loss(x, y)
        optimizer = make_optimizer() if learning_rate is None else make_optimizer(learning_rate(gs))
        train = optimizer.minimize(loss, global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            snapshots, losses = [], []
            for j, feed in enumerate(feeds):
                losses.append(sess.run([loss, train], feed)[0])
                if (j + 1) % steps == 0:
                    snapshots.append(all_values(sess))
    return snapshots, np.array(losses, np.float32)


def run_fused(build_loss, make_optimizer, steps, runs, *, per_step=False, learning_rate=None,
              mode="unrolled", xla=False):
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        if per_step:
            xs = V1.placeholder(tf.float32, [steps, BATCH, 3])
            ys = V1.placeholder(tf.int32, [steps, BATCH])
            feeds = [{xs: DATA_X[r * steps:(r + 1) * steps], ys: DATA_Y[r * steps:(r + 1) * steps]}
                     for r in range(runs)]
            unrolled = ms.unroll(build_loss, make_optimizer() if learning_rate is None
                                 else make_optimizer(lambda: learning_rate(gs)),
                                 steps, inputs=(xs, ys), global_step=gs, mode=mode, xla=xla)
        else:
            feeds = [{}] * runs
            unrolled = ms.unroll(lambda: build_loss(DATA_X[0], DATA_Y[0]),
                                 make_optimizer() if learning_rate is None
                                 else make_optimizer(lambda: learning_rate(gs)),
                                 steps, global_step=gs, mode=mode, xla=xla)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            snapshots, losses = [], []
            for feed in feeds:
                losses.append(sess.run([unrolled.train_op, unrolled.losses], feed)[1])
                snapshots.append(all_values(sess))
    return snapshots, np.concatenate(losses)


def assert_same_states(fused, reference, steps):
    for run, (got, want) in enumerate(zip(fused, reference), start=1):
        assert sorted(got) == sorted(want), "variable names differ from the single-step graph"
        for name in sorted(want):
            assert got[name].dtype == want[name].dtype, name
            if got[name].tobytes() != want[name].tobytes():
                diff = np.abs(got[name].astype(np.float64) - want[name]).max()
                pytest.fail(f"{name!r} diverged after fused run {run} (global step "
                            f"{run * steps}): max |Δ| = {diff:.3g}")
    assert len(fused) == len(reference)


@pytest.mark.parametrize("per_step", [False, True], ids=["fixed-batch", "per-step-inputs"])
@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_matches_single_steps_bitwise(optimizer, steps, use_resource, per_step):
    def build_loss(x, y):
        return mlp_loss(x, y, use_resource)

    want, want_losses = run_reference(build_loss, OPTIMIZERS[optimizer], steps, RUNS, per_step=per_step)
    got, got_losses = run_fused(build_loss, OPTIMIZERS[optimizer], steps, RUNS, per_step=per_step)
    assert_same_states(got, want, steps)
    assert got_losses.tobytes() == want_losses.tobytes()
    assert got[-1]["global_step"] == steps * RUNS
    # The run trained: a stuck or skipped step would leave the weights where they began.
    assert not np.array_equal(got[-1]["layer1/w"], INIT["layer1/w"])


@pytest.mark.parametrize("per_step", [False, True], ids=["fixed-batch", "per-step-inputs"])
@pytest.mark.parametrize("steps", [1, 5, 17])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_loop_mode_matches_single_steps_bitwise(optimizer, steps, per_step):
    def build_loss(x, y):
        return mlp_loss(x, y, True)

    want, want_losses = run_reference(build_loss, OPTIMIZERS[optimizer], steps, RUNS, per_step=per_step)
    got, got_losses = run_fused(build_loss, OPTIMIZERS[optimizer], steps, RUNS, per_step=per_step,
                                mode="while_loop")
    assert_same_states(got, want, steps)
    assert got_losses.tobytes() == want_losses.tobytes()
    assert got[-1]["global_step"] == steps * RUNS


def test_callable_learning_rate_advances_inside_a_run():
    def schedule(gs):
        return V1.train.exponential_decay(0.5, gs, 2, 0.5)

    def build_loss(x, y):
        return mlp_loss(x, y, True)

    def momentum(lr):
        return V1.train.MomentumOptimizer(lr, 0.9)

    want, want_losses = run_reference(build_loss, momentum, 5, RUNS, learning_rate=schedule)
    got, got_losses = run_fused(build_loss, momentum, 5, RUNS, learning_rate=schedule)
    assert_same_states(got, want, 5)
    assert got_losses.tobytes() == want_losses.tobytes()
    assert got[-1]["global_step"] == 5 * RUNS
    # A learning rate frozen at the start of each run would land elsewhere.
    frozen, _ = run_reference(build_loss, lambda: momentum(0.5), 5, RUNS)
    assert not np.array_equal(got[-1]["layer1/w"], frozen[-1]["layer1/w"])


def keras_model():
    const = keras.initializers.Constant
    return [keras.layers.Dense(4, activation="tanh", name="hidden",
                               kernel_initializer=const(INIT["layer1/w"]),
                               bias_initializer=const(INIT["layer1/b"])),
            keras.layers.Dense(2, name="logits", kernel_initializer=const(INIT["layer2/w"]))]


def keras_loss(layers, x, y):
    for layer in layers:
        x = layer(x)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=x))


@pytest.mark.parametrize("per_step", [False, True], ids=["fixed-batch", "per-step-inputs"])
def test_keras_layers_created_outside_loss_fn(per_step):
    def fused_loss(*args):
        return keras_loss(layers, *args)

    def reference_loss(x, y):
        return keras_loss(keras_model(), x, y)

    want, want_losses = run_reference(reference_loss, OPTIMIZERS["Adam"], 3, RUNS, per_step=per_step)
    with tf.Graph().as_default():
        layers = keras_model()
    got, got_losses = run_fused(fused_loss, OPTIMIZERS["Adam"], 3, RUNS, per_step=per_step)
    assert "hidden/kernel" in got[0] and "hidden/kernel/Adam" in got[0]
    assert_same_states(got, want, 3)
    assert got_losses.tobytes() == want_losses.tobytes()


def test_variable_names_are_those_of_a_single_step_graph_under_a_name_scope():
    with tf.Graph().as_default():
        layer = keras.layers.Dense(2, name="dense")
        with tf.name_scope("tower"):
            ms.unroll(lambda: tf.reduce_sum(layer(DATA_X[0])), V1.train.AdamOptimizer(0.1), 3)
        fused = sorted(v.op.name for v in V1.global_variables())
    with tf.Graph().as_default():
        layer = keras.layers.Dense(2, name="dense")
        with tf.name_scope("tower"):
            V1.train.AdamOptimizer(0.1).minimize(tf.reduce_sum(layer(DATA_X[0])))
        single = sorted(v.op.name for v in V1.global_variables())
    assert fused == single
    assert "tower/beta1_power" in fused


def test_graph_folds_into_named_step_scopes():
    with tf.Graph().as_default() as graph:
        ms.unroll(lambda: mlp_loss(DATA_X[0], DATA_Y[0], True),
                  V1.train.GradientDescentOptimizer(0.1), 3, name="fit")
        scopes = {op.name.split("/")[1] + "/" + op.name.split("/")[2]
                  for op in graph.get_operations() if op.name.startswith("fit/step_")}
    assert scopes == {f"step_{k}/{part}" for k in (1, 2, 3)
                      for part in ("forward", "gradients", "check", "apply", "end")}


def test_losses_alone_runs_the_steps_once():
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        unrolled = ms.unroll(lambda: w * w, V1.train.GradientDescentOptimizer(0.25), 3)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(unrolled.losses), [1.0, 0.25, 0.0625])
            assert sess.run(w) == 0.125


def test_var_list_restricts_training():
    with tf.Graph().as_default():
        a, b = tf.Variable(1.0, name="a"), tf.Variable(1.0, name="b")
        unrolled = ms.unroll(lambda: a * b, V1.train.GradientDescentOptimizer(0.5), 2, var_list=[a])
        assert unrolled.var_list == (a,)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(unrolled.train_op)
            assert sess.run([a, b]) == [0.0, 1.0]  # a: 1 - 0.5*1 = 0.5, then 0.5 - 0.5 = 0


def test_default_var_list_is_the_variables_with_gradients():
    with tf.Graph().as_default():
        used, unused = tf.Variable(1.0, name="used"), tf.Variable(1.0, name="unused")
        unrolled = ms.unroll(lambda: used * 2.0, V1.train.GradientDescentOptimizer(0.5), 2)
        assert unrolled.var_list == (used,)
        assert unused is not None


def test_dynamic_leading_dimension_is_checked_at_run_time():
    with tf.Graph().as_default():
        xs = V1.placeholder(tf.float32, [None, 3])
        w = tf.Variable(tf.ones([3]))
        unrolled = ms.unroll(lambda x: tf.reduce_sum(x * w), V1.train.GradientDescentOptimizer(0.1),
                             2, inputs=xs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(unrolled.train_op, {xs: np.ones([2, 3])})
            with pytest.raises(tf.errors.InvalidArgumentError, match="leading dimension must equal steps=2"):
                sess.run(unrolled.train_op, {xs: np.ones([3, 3])})


def test_nested_inputs_and_single_argument():
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        batch = {"x": tf.constant([1.0, 2.0]), "scale": tf.constant([3.0, 4.0])}
        seen = []

        def loss_fn(step_batch):
            seen.append(sorted(step_batch))
            return step_batch["scale"] * w * step_batch["x"]

        unrolled = ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.0), 2, inputs=batch)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(unrolled.losses), [3.0, 8.0])
    assert seen == [["scale", "x"]]  # called once: the single step, which both steps run


# Bad input: each names the argument at fault.

def _unroll_simple(**overrides):
    with tf.Graph().as_default():
        w = tf.Variable(1.0, name="w")
        kwargs = dict(loss_fn=lambda: w * w, optimizer=V1.train.GradientDescentOptimizer(0.1), steps=2)
        kwargs.update(overrides)
        if callable(kwargs.get("setup")):
            kwargs = kwargs.pop("setup")(w, kwargs)
        return ms.unroll(kwargs.pop("loss_fn"), kwargs.pop("optimizer"), kwargs.pop("steps"), **kwargs)


@pytest.mark.parametrize("steps,error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                         ("3", TypeError), (True, TypeError), (None, TypeError)])
def test_bad_steps(steps, error):
    with pytest.raises(error, match="steps must be an int >= 1"):
        _unroll_simple(steps=steps)


def test_numpy_integer_steps_are_accepted():
    assert _unroll_simple(steps=np.int64(2)).steps == 2


def test_tensor_instead_of_callable():
    def setup(w, kwargs):
        kwargs["loss_fn"] = w * w
        return kwargs

    with pytest.raises(TypeError, match="loss_fn must be a callable.*got the tensor"):
        _unroll_simple(setup=setup)


def test_non_scalar_loss():
    def setup(w, kwargs):
        kwargs["loss_fn"] = lambda: w * tf.ones([3])
        return kwargs

    with pytest.raises(ValueError, match=r"scalar loss, got shape \(3,\)"):
        _unroll_simple(setup=setup)


def test_non_float_loss():
    with pytest.raises(TypeError, match="float loss, got dtype int32"):
        _unroll_simple(loss_fn=lambda: tf.constant(3))


def test_var_list_variable_without_gradient_path():
    def setup(w, kwargs):
        kwargs["var_list"] = [w, tf.Variable(2.0, name="orphan")]
        return kwargs

    with pytest.raises(ValueError, match="var_list: no gradient path from the loss to 'orphan:0'"):
        _unroll_simple(setup=setup)


def test_loss_without_any_trainable_variable():
    with pytest.raises(ValueError, match="no gradient with respect to any trainable variable"):
        _unroll_simple(loss_fn=lambda: tf.constant(3.0) * 2.0)


@pytest.mark.parametrize("optimizer", [keras.optimizers.SGD(0.1), "sgd", None])
def test_optimizer_not_a_v1_optimizer(optimizer):
    with pytest.raises(TypeError, match="optimizer must be a tf.compat.v1.train.Optimizer"):
        _unroll_simple(optimizer=optimizer)


def test_inputs_with_wrong_leading_dimension():
    def setup(w, kwargs):
        kwargs["inputs"] = (tf.zeros([3, 4]),)
        kwargs["loss_fn"] = lambda x: tf.reduce_sum(x) * w
        return kwargs

    with pytest.raises(ValueError, match="inputs .* has leading dimension 3, expected steps=2"):
        _unroll_simple(setup=setup)


def test_bad_global_step():
    def setup(w, kwargs):
        kwargs["global_step"] = w  # a float variable
        return kwargs

    with pytest.raises(TypeError, match="global_step must be an integer variable"):
        _unroll_simple(setup=setup)


def test_eager_mode_is_refused():
    w = tf.Variable(1.0)
    with pytest.raises(RuntimeError, match="builds a tf.compat.v1 graph"):
        ms.unroll(lambda: w * w, V1.train.GradientDescentOptimizer(0.1), 2)


def _adam_steps():
    w = V1.get_variable("w", initializer=np.array([1.0, -2.0], np.float32), use_resource=True)
    x = tf.constant([[1.0, 2.0], [3.0, -1.0]])
    return ms.unroll(lambda: tf.reduce_sum(tf.square(tf.matmul(x, w[:, None]) - 1.0)),
                     V1.train.AdamOptimizer(0.05), 4)


def test_run_through_its_cached_callable_equals_sess_run_of_the_losses_bitwise():
    """Unrolled.run (a make_callable made once per session) against sess.run(losses)."""
    results = []
    for use_run in (True, False):
        with tf.Graph().as_default():
            unrolled = _adam_steps()
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                losses = [unrolled.run(sess) if use_run else sess.run(unrolled.losses)
                          for _ in range(RUNS)]
                results.append((np.stack(losses), sess.run(V1.global_variables())))
    (run_losses, run_state), (plain_losses, plain_state) = results
    assert run_losses.tobytes() == plain_losses.tobytes()
    assert [v.tobytes() for v in run_state] == [v.tobytes() for v in plain_state]


def test_run_lets_closed_sessions_go():
    """The cached callable holds its session: a closed one's is dropped at the next run."""
    import gc
    import weakref

    with tf.Graph().as_default():
        unrolled = _adam_steps()
        init = V1.global_variables_initializer()
        sessions = []
        for _ in range(3):
            with V1.Session() as sess:
                sess.run(init)
                unrolled.run(sess)
            sessions.append(weakref.ref(sess))
        del sess
        gc.collect()
        assert [ref() is None for ref in sessions] == [True, True, False]  # the last is still cached
