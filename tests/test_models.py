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
    # Under TensorFlow's default configuration; the one exception found (README, "Models"):
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
