"""Gradient transforms, checked against numpy re-implementations of the update."""

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
rng = np.random.RandomState(0)
X = rng.randn(16, 3).astype(np.float32)
T = (X @ np.array([3.0, -2.0, 1.0], np.float32) + 5.0).astype(np.float32)  # big gradients at w = 0


def regression_loss():
    w = V1.get_variable("w", [3], initializer=V1.zeros_initializer())
    return tf.reduce_mean(tf.square(tf.linalg.matvec(X, w) - T))


def np_grad(w):
    return (2.0 / len(X)) * X.T @ (X @ w - T)


def train(optimizer, transforms, steps=3, runs=2):
    """Runs ms.unroll; returns every variable by name."""
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        unrolled = ms.unroll(regression_loss, optimizer, steps, grad_transforms=transforms,
                             global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for _ in range(runs):
                sess.run(unrolled.train_op)
            return {v.op.name: sess.run(v) for v in V1.global_variables()}


def np_clip_global_norm(g, c):
    return g * c / max(np.linalg.norm(g), c)


def np_adam(grads_fn, steps, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    w, m, v = np.zeros(3), np.zeros(3), np.zeros(3)
    for t in range(1, steps + 1):
        g = grads_fn(w)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps)
    return w, m, v


def np_momentum(grads_fn, steps, lr=0.01, mu=0.9):
    w, a = np.zeros(3), np.zeros(3)
    for _ in range(steps):
        a = mu * a + grads_fn(w)
        w = w - lr * a
    return w, a


def test_adam_slots_accumulate_the_clipped_gradients():
    got = train(V1.train.AdamOptimizer(0.1), [ms.clip_by_global_norm(1.0)], steps=3, runs=2)
    w, m, v = np_adam(lambda w: np_clip_global_norm(np_grad(w), 1.0), 6)
    np.testing.assert_allclose(got["w/Adam"], m, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(got["w/Adam_1"], v, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(got["w"], w, rtol=1e-4, atol=1e-6)
    _, raw_m, _ = np_adam(np_grad, 6)
    assert np.abs(got["w/Adam"] - raw_m).max() > 100 * np.abs(got["w/Adam"] - m).max() + 1e-3


def test_momentum_accumulator_holds_the_clipped_gradients():
    got = train(V1.train.MomentumOptimizer(0.01, 0.9), [ms.clip_by_value(-0.5, 0.5)], steps=2, runs=3)
    w, a = np_momentum(lambda w: np.clip(np_grad(w), -0.5, 0.5), 6)
    np.testing.assert_allclose(got["w/Momentum"], a, rtol=1e-5)
    np.testing.assert_allclose(got["w"], w, rtol=1e-5)
    _, raw_a = np_momentum(np_grad, 6)
    assert np.abs(got["w/Momentum"] - raw_a).max() > 1.0


def test_transforms_apply_in_order():
    # scale then clip caps at 0.5; clip then scale would reach 5 * 0.5 = 2.5.
    got = train(V1.train.GradientDescentOptimizer(1.0), [ms.scale(5.0), ms.clip_by_value(-0.5, 0.5)],
                steps=1, runs=1)
    np.testing.assert_allclose(got["w"], -np.clip(5 * np_grad(np.zeros(3)), -0.5, 0.5), rtol=1e-4)


# Sparse gradients: repeated indices are summed before any cap.

IDS = np.array([0, 0, 3, 0], np.int32)      # row 0 looked up three times
COEF = np.array([[3.0, -1.0], [3.0, -1.0], [1.0, 2.0], [3.0, -1.0]], np.float32)
EMB0 = np.arange(10, dtype=np.float32).reshape(5, 2) / 10.0


def embedding_loss(sparse):
    emb = V1.get_variable("emb", initializer=EMB0)
    if sparse:
        rows = tf.gather(emb, IDS)                    # gradient: IndexedSlices, index 0 thrice
    else:
        rows = tf.matmul(tf.one_hot(IDS, 5), emb)     # the same function, dense gradient
    return tf.reduce_sum(rows * COEF)


def embedding_update(transform, *, sparse, lr=0.1, steps=1):
    with tf.Graph().as_default():
        [(grad, _)] = V1.train.GradientDescentOptimizer(lr).compute_gradients(embedding_loss(sparse))
        assert isinstance(grad, tf.IndexedSlices) == sparse
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        unrolled = ms.unroll(lambda: embedding_loss(sparse), V1.train.GradientDescentOptimizer(lr),
                             steps, grad_transforms=[transform], global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(unrolled.train_op)
            return sess.run(V1.get_collection(V1.GraphKeys.GLOBAL_VARIABLES, "emb")[0])


def np_dense_grad():
    g = np.zeros((5, 2), np.float32)
    np.add.at(g, IDS, COEF)     # row 0: [9, -3]; row 3: [1, 2]
    return g


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_clip_by_value_caps_the_summed_row(sparse):
    got = embedding_update(ms.clip_by_value(-4.0, 4.0), sparse=sparse)
    want = EMB0 - 0.1 * np.clip(np_dense_grad(), -4.0, 4.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.abs(got - EMB0).max() <= 0.1 * 4.0 + 1e-6  # the row moved by the cap, not 3 x 3
    np.testing.assert_array_equal(got[[1, 2, 4]], EMB0[[1, 2, 4]])  # untouched rows stay


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_clip_by_global_norm_uses_the_summed_rows(sparse):
    got = embedding_update(ms.clip_by_global_norm(2.0), sparse=sparse)
    g = np_dense_grad()
    want = EMB0 - 0.1 * g * 2.0 / np.linalg.norm(g)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.linalg.norm(got - EMB0) == pytest.approx(0.1 * 2.0, rel=1e-5)


@pytest.mark.parametrize("transform", [ms.clip_by_norm(1.5), ms.scale(-0.5), ms.add_noise(0.3, seed=4)],
                         ids=lambda t: t.__name__)
def test_dense_and_sparse_agree_on_the_touched_rows(transform):
    sparse = embedding_update(transform, sparse=True)
    dense = embedding_update(transform, sparse=False)
    touched = [0, 3]
    np.testing.assert_allclose(sparse[touched], dense[touched], rtol=1e-6)
    np.testing.assert_array_equal(sparse[[1, 2, 4]], EMB0[[1, 2, 4]])


def test_dedupe_sparse_sums_rows():
    with tf.Graph().as_default():
        g = tf.IndexedSlices(tf.constant(COEF), tf.constant(IDS), tf.constant([5, 2]))
        [(summed, _)] = ms.dedupe_sparse([(g, None)])
        with V1.Session() as sess:
            values, indices = sess.run([summed.values, summed.indices])
    dense = np.zeros((5, 2), np.float32)
    dense[indices] = values
    np.testing.assert_array_equal(dense, np_dense_grad())
    assert sorted(indices) == [0, 3]


# Noise that reproduces.

def test_noise_is_keyed_on_seed_step_and_variable():
    with tf.Graph().as_default():
        a, b = tf.Variable(tf.zeros(4), name="a"), tf.Variable(tf.zeros(4), name="b")
        zero = [(tf.zeros(4), a), (tf.zeros(4), b)]

        def draw(seed, step):
            return [g for g, _ in ms.add_noise(1.0, seed=seed)(zero, tf.constant(step, tf.int64))]

        with V1.Session() as sess:
            (a1, b1), (a1_again, _), (a2, _), (a1_seed, _) = sess.run(
                [draw(0, 1), draw(0, 1), draw(0, 2), draw(1, 1)])
    np.testing.assert_array_equal(a1, a1_again)
    for other in (b1, a2, a1_seed):
        assert not np.array_equal(a1, other)


def test_noise_decays_with_the_global_step():
    with tf.Graph().as_default():
        v = tf.Variable(tf.zeros(2000), name="v")
        noisy = ms.add_noise(2.0, mean=1.0, decay=0.5, seed=0)
        draws = [noisy([(tf.zeros(2000), v)], tf.constant(t, tf.int64))[0][0] for t in (0, 99)]
        with V1.Session() as sess:
            early, late = sess.run(draws)
    assert early.mean() == pytest.approx(1.0, abs=0.15) and early.std() == pytest.approx(2.0, rel=0.1)
    assert late.std() == pytest.approx(2.0 / np.sqrt(100.0), rel=0.1)


def test_none_gradients_pass_through():
    with tf.Graph().as_default():
        v, w = tf.Variable(1.0, name="v"), tf.Variable(2.0, name="w")
        gvs = [(None, v), (tf.constant(10.0), w)]
        for t in [ms.clip_by_value(-1.0, 1.0), ms.clip_by_norm(1.0), ms.clip_by_global_norm(1.0),
                  ms.scale(2.0), ms.add_noise(1.0, seed=0), ms.dedupe_sparse,
                  ms.chain(ms.scale(2.0), ms.clip_by_norm(1.0))]:
            out = t(gvs, tf.constant(0, tf.int64))
            assert out[0] == (None, v) and out[1][1] is w and out[1][0] is not None


# ms.verify passes bitwise with each transform (noise included), for N in {1, 3, 7}.

TRANSFORMS = {
    "clip_by_value": lambda: [ms.clip_by_value(-0.3, 0.3)],
    "clip_by_norm": lambda: [ms.clip_by_norm(0.5)],
    "clip_by_global_norm": lambda: [ms.clip_by_global_norm(0.7)],
    "add_noise": lambda: [ms.add_noise(0.05, decay=0.55, seed=11)],
    "scale": lambda: [ms.scale(0.5)],
    "chain": lambda: [ms.chain(ms.add_noise(0.1, seed=1), ms.clip_by_global_norm(1.0))],
    "user_callable": lambda: [halve],
}


def halve(grads_and_vars, step):
    """A transform written by a user: halves dense and sparse gradients."""
    def half(g):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values * 0.5, g.indices, g.dense_shape)
        return g * 0.5
    return [(None if g is None else half(g), v) for g, v in grads_and_vars]


@pytest.mark.parametrize("steps", [1, 3, 7])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_verify_passes_bitwise_with_each_transform(name, steps):
    def build(n):
        def loss_fn():
            emb = V1.get_variable("emb", initializer=EMB0)
            w = V1.get_variable("w", [2], initializer=V1.constant_initializer([0.5, -0.5]))
            return tf.reduce_sum(tf.square(tf.linalg.matvec(tf.gather(emb, IDS), w) - 1.0))

        return ms.unroll(loss_fn, V1.train.AdamOptimizer(0.05), n, grad_transforms=TRANSFORMS[name](),
                         global_step=V1.train.get_or_create_global_step()), {}

    report = ms.verify(build, steps=steps, runs=3)
    assert report.ok and report.bitwise, str(report)


# Bad input names the transform.

@pytest.mark.parametrize("make,message", [
    (lambda: ms.clip_by_norm(0.0), "clip_by_norm: max_norm must be a number > 0"),
    (lambda: ms.clip_by_norm(-1.0), "clip_by_norm: max_norm must be a number > 0"),
    (lambda: ms.clip_by_global_norm(0), "clip_by_global_norm: max_norm must be a number > 0"),
    (lambda: ms.clip_by_value(2.0, 1.0), "clip_by_value: lo must be <= hi"),
    (lambda: ms.add_noise(-1.0, seed=0), "add_noise: stddev must be a number >= 0"),
])
def test_bad_transform_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _unroll_with(transform, global_step=True):
    with tf.Graph().as_default():
        v = tf.Variable([1.0, 2.0], name="v")
        gs = V1.train.get_or_create_global_step() if global_step else None
        ms.unroll(lambda: tf.reduce_sum(v * v), V1.train.GradientDescentOptimizer(0.1), 2,
                  grad_transforms=[transform], global_step=gs)


def test_transform_returning_the_wrong_number_of_pairs():
    def drop_all(grads_and_vars, step):
        return []

    with pytest.raises(ValueError, match="gradient transform drop_all returned 0 items for 1"):
        _unroll_with(drop_all)


def test_transform_changing_a_variable():
    other = []

    def swap(grads_and_vars, step):
        other.append(tf.Variable(0.0, name="other"))
        return [(g, other[0]) for g, _ in grads_and_vars]

    with pytest.raises(ValueError, match="gradient transform swap changed the variable of pair 'v:0'"):
        _unroll_with(swap)


def test_transform_changing_a_shape():
    def flatten_sum(grads_and_vars, step):
        return [(tf.reduce_sum(g), v) for g, v in grads_and_vars]

    with pytest.raises(ValueError, match=r"flatten_sum changed the shape of 'v:0'.*\(2,\) to \(\)"):
        _unroll_with(flatten_sum)


def test_noise_without_a_global_step():
    with pytest.raises(ValueError, match=r"add_noise\(0.1.*keys its noise on the global step"):
        _unroll_with(ms.add_noise(0.1, seed=0), global_step=False)


def test_grad_transforms_must_be_a_list():
    with pytest.raises(TypeError, match="grad_transforms must be a list"):
        with tf.Graph().as_default():
            v = tf.Variable(1.0)
            ms.unroll(lambda: v * v, V1.train.GradientDescentOptimizer(0.1), 2,
                      grad_transforms=ms.scale(2.0))
