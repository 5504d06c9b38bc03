"""The bitwise promise across ordinary TF1 model shapes, under the DEFAULT session
configuration: weights read several times in one loss (hand-unrolled RNN, triplet and
siamese towers, tied embeddings). Each is compared with plain single steps,
`opt.minimize(loss)` once per sess.run, from identical initial values.

Why these models: the gradient of a weight used k >= 3 times is a sum of k terms, and
Grappler's common-subgraph elimination (on whenever the arithmetic optimizer is) sorts the
inputs of every AddN by name before running it. tf.gradients and a GradientTape name the
same terms differently (`.../MatMul_grad/...` against `gradient_tape/.../MatMul/...`), so
the two sort them into different orders and float32 addition rounds differently."""

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
rng = np.random.RandomState(11)
X = rng.randn(6, 4, 4).astype(np.float32)   # one batch per step
IDS = np.array([[0, 2], [1, 2], [0, 3], [2, 2], [3, 1], [0, 0]], np.int32)


def rnn(x, use_resource=True):
    w = V1.get_variable("rnn/w", initializer=rng_init((4, 4), 0.5), use_resource=use_resource)
    h = x
    for _ in range(3):  # hand-unrolled: w read three times
        h = tf.tanh(h @ w)
    return tf.reduce_sum(h * h)


def triplet(x):
    w = V1.get_variable("tower/w", initializer=rng_init((4, 3), 0.4))
    b = V1.get_variable("tower/b", initializer=np.zeros(3, np.float32))
    anchor, positive, negative = (tf.nn.relu(t @ w + b) for t in (x, x[::-1], x * 0.5))
    return tf.reduce_mean(tf.nn.relu(tf.reduce_sum(tf.square(anchor - positive), 1)
                                     - tf.reduce_sum(tf.square(anchor - negative), 1) + 1.0))


def siamese_l2(x):
    w = V1.get_variable("siamese/w", initializer=rng_init((4, 3), 0.3))
    left, right = tf.tanh(x @ w), tf.tanh(x[::-1] @ w)
    return tf.reduce_mean(tf.square(left - right)) + 0.01 * tf.nn.l2_loss(w)


def tied_embedding(x, step):
    emb = V1.get_variable("emb", initializer=rng_init((4, 4), 0.2))
    ids = tf.gather(tf.constant(IDS), step)
    rows = [tf.gather(emb, ids[0]), tf.gather(emb, ids[1]), tf.gather(emb, ids[0])]
    logits = tf.stack(rows) @ tf.transpose(emb)  # tied output layer: emb read densely too
    return tf.reduce_mean(tf.square(logits - tf.reduce_mean(x)))


def rng_init(shape, scale):
    return (np.random.RandomState(3).randn(*shape) * scale).astype(np.float32)


MODELS = {"rnn": rnn, "triplet": triplet, "siamese_l2": siamese_l2, "tied_embedding": tied_embedding}
OPTIMIZERS = {"GradientDescent": lambda: V1.train.GradientDescentOptimizer(0.5),
              "Adam": lambda: V1.train.AdamOptimizer(0.05)}


def call(model, x, step):
    return model(x, step) if model is tied_embedding else model(x)


def single_steps(model, optimizer, steps, config=None, **kw):
    with tf.Graph().as_default():
        x, step = V1.placeholder(tf.float32, [4, 4]), V1.placeholder(tf.int32, [])
        train = optimizer().minimize(call(model, x, step) if not kw else model(x, **kw))
        with V1.Session(config=config) as sess:
            sess.run(V1.global_variables_initializer())
            for k in range(steps):
                sess.run(train, {x: X[k], step: k})
            return {v.op.name: sess.run(v) for v in V1.global_variables()}


def fused_steps(model, optimizer, steps, runs, mode, config=None, **kw):
    with tf.Graph().as_default():
        xs = V1.placeholder(tf.float32, [steps, 4, 4])
        ks = V1.placeholder(tf.int32, [steps])
        unrolled = ms.unroll(lambda x, k: call(model, x, k) if not kw else model(x, **kw),
                             optimizer(), steps, inputs=(xs, ks), mode=mode)
        with V1.Session(config=config) as sess:
            sess.run(V1.global_variables_initializer())
            for r in range(runs):
                window = slice(r * steps, (r + 1) * steps)
                sess.run(unrolled.train_op, {xs: X[window], ks: np.arange(6)[window]})
            return {v.op.name: sess.run(v) for v in V1.global_variables()}


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_weights_read_several_times_are_bitwise(model, optimizer, mode):
    # Under TensorFlow's default configuration; the one exception found (docs/guides/models.md):
    # the triplet tower with Adam in loop mode, bitwise with ms.session_config().
    config = ms.session_config() if (model, optimizer, mode) == ("triplet", "Adam", "while_loop") else None
    want = single_steps(MODELS[model], OPTIMIZERS[optimizer], 6, config=config)
    got = fused_steps(MODELS[model], OPTIMIZERS[optimizer], 3, 2, mode, config=config)
    assert sorted(got) == sorted(want)
    differ = {n: float(np.abs(got[n] - want[n]).max()) for n in want
              if got[n].tobytes() != want[n].tobytes()}
    assert not differ, differ


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_rnn_with_ref_variables_is_bitwise(optimizer):
    want = single_steps(rnn, OPTIMIZERS[optimizer], 6, use_resource=False)
    got = fused_steps(rnn, OPTIMIZERS[optimizer], 3, 2, "unrolled", use_resource=False)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)


def test_verify_reports_the_rnn_bitwise():
    def build(steps):
        xs = tf.constant(np.repeat(X[:1], steps, 0))
        return ms.unroll(rnn, V1.train.GradientDescentOptimizer(0.5), steps, inputs=(xs,)), {}

    report = ms.verify(build, steps=4, runs=3)
    assert report.ok and report.bitwise, report.summary()


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_is_bitwise_under_the_session_config(model, mode):
    config = ms.session_config()
    want = single_steps(MODELS[model], OPTIMIZERS["Adam"], 6, config=config)
    got = fused_steps(MODELS[model], OPTIMIZERS["Adam"], 3, 2, mode, config=config)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
@pytest.mark.parametrize("dtype", [tf.float16, tf.float64])
def test_records_are_float32_whatever_the_variables_dtype(dtype, mode):
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=tf.constant([3.0, -4.0], dtype))
        unrolled = ms.unroll(lambda: tf.reduce_sum(w * w), V1.train.GradientDescentOptimizer(0.1), 3,
                             record=["grad_norm", "learning_rate"], mode=mode)
        assert unrolled.records["grad_norm"].dtype == tf.float32
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            norms = sess.run(unrolled.records["grad_norm"])
    # numpy reference in the variables' dtype: w := w - lr * 2w, norm of 2w. Step 1's norm,
    # |2 * (3, -4)| = 10, is exact in every dtype. Later ones differ from the reference by
    # the update's roundings in the variables' dtype (at most 2 per step, each at most half
    # an ulp of |w| <= 4), and the record's float32: the cast and the norm's square, sum
    # and root, each at most half a float32 ulp of values <= 10 (2 * eps32 * 10 in all).
    # Bound: 2 steps * 2 roundings * eps(dtype) * 10 + 2 * eps32 * 10.
    ref, w_np, lr = [], np.array([3.0, -4.0], dtype.as_numpy_dtype), dtype.as_numpy_dtype(0.1)
    for _ in range(3):
        ref.append(np.linalg.norm(2.0 * w_np.astype(np.float64)))
        w_np = w_np - lr * (w_np + w_np)
    assert norms[0] == 10.0
    bound = (4 * np.finfo(dtype.as_numpy_dtype).eps + 2 * np.finfo(np.float32).eps) * 10
    np.testing.assert_allclose(norms, ref, rtol=0, atol=bound)  # the bound derived above


@pytest.mark.parametrize("options", [
    {"gate_gradients": V1.train.Optimizer.GATE_GRAPH},
    {"aggregation_method": tf.AggregationMethod.EXPERIMENTAL_TREE},
    {"colocate_gradients_with_ops": True},
])
def test_minimize_options_are_passed_to_compute_gradients(options):
    want = single_steps_with(options, 6)
    got = fused_steps_with(options, 3, 2)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)


def single_steps_with(options, steps):
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, [4, 4])
        train = V1.train.AdamOptimizer(0.05).minimize(rnn(x), **options)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for k in range(steps):
                sess.run(train, {x: X[k]})
            return {v.op.name: sess.run(v) for v in V1.global_variables()}


def fused_steps_with(options, steps, runs):
    with tf.Graph().as_default():
        xs = V1.placeholder(tf.float32, [steps, 4, 4])
        unrolled = ms.unroll(rnn, V1.train.AdamOptimizer(0.05), steps, inputs=(xs,), **options)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for r in range(runs):
                sess.run(unrolled.train_op, {xs: X[r * steps:(r + 1) * steps]})
            return {v.op.name: sess.run(v) for v in V1.global_variables()}


def test_grad_loss_scales_every_step_and_the_stale_check_still_applies():
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=1.0)
        fused = ms.unroll(lambda: w * w, V1.train.GradientDescentOptimizer(0.25), 2,
                          grad_loss=tf.constant(2.0))
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(fused.train_op)
            assert sess.run(w) == 0.0  # w -= 0.25 * 2 * 2w: 1 -> 0 -> 0
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=1.0)
        stale = w * w
        with pytest.raises(ms.StaleForwardError):
            ms.unroll(lambda: stale + 0.0, V1.train.GradientDescentOptimizer(0.25), 2,
                      gate_gradients=V1.train.Optimizer.GATE_GRAPH)


def test_a_slow_unrolled_build_warns_and_recommends_loop_mode(monkeypatch):
    import importlib
    import warnings

    # any build counts as slow
    monkeypatch.setattr(importlib.import_module("multistep.builder.unroll"), "SLOW_BUILD_SECONDS", 0.0)
    for xla in (False, True):
        with tf.Graph().as_default(), pytest.warns(RuntimeWarning,
                                                   match=r"will take about .*while_loop") as caught:
            ms.unroll(lambda: V1.get_variable("w", initializer=1.0, use_resource=True) ** 2,
                      V1.train.GradientDescentOptimizer(0.1), 3, xla=xla)
        assert {r.filename for r in caught} == {__file__}  # the line that called ms.unroll
    with tf.Graph().as_default(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # loop mode: no warning
        ms.unroll(lambda: V1.get_variable("w", initializer=1.0) ** 2,
                  V1.train.GradientDescentOptimizer(0.1), 3, mode="while_loop")
