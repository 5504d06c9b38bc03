"""Gradient transforms, checked against numpy re-implementations of the update."""

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
EPS32 = 2.0 ** -24  # float32 unit roundoff: one rounding moves a value by at most EPS32 relative
rng = np.random.RandomState(0)
X = rng.randn(16, 3).astype(np.float32)
T = (X @ np.array([3.0, -2.0, 1.0], np.float32) + 5.0).astype(np.float32)  # big gradients at w = 0


def regression_loss():
    w = V1.get_variable("w", [3], initializer=V1.zeros_initializer())
    return tf.reduce_mean(tf.square(tf.linalg.matvec(X, w) - T))


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


# The numpy references run in float64 and carry a bound on how far TensorFlow's float32 run of
# the same operations can be from them, so each comparison's tolerance is derived, entry by
# entry, from the arithmetic instead of being picked: every float32 operation rounds once
# (<= EPS32 relative; sqrt is charged 2 EPS32, one ulp), a dot product of n terms is within
# n EPS32 |A||x| in any order, with or without FMA (Higham, Accuracy and Stability of Numerical
# Algorithms, 3.1), and each operation passes its inputs' errors on by its worst case over them
# (a product |b|e_a + |a|e_b + e_a e_b, a quotient (e_a + |a/b| e_b) / (|b| - e_b), ...): a
# rigorous bound, not a first-order one. The conditioning is in it: the regression gradient
# (2/16) X^T (Xw - T) cancels in its third entry (|g_3| ~ 0.004 against terms summing to ~9),
# so its bound there is ~1e-3 relative, and the slots and weights that accumulate it inherit
# that. Safety factor 2 (see within()): the operations are mirrored from the kernels
# (training_ops.cc) and clip ops as read; a kernel grouping one differently costs at most one
# more rounding per operation, i.e. at most doubles a charge, and the float64 reference's own
# rounding (2^-53 per operation) is 2^-29 of the charge for the same operation.

class Bounded:
    """A float64 value and a bound on |float32 computation of it - value|, entry by entry."""

    __array_ufunc__ = None  # ndarray - Bounded: numpy defers to Bounded.__rsub__

    def __init__(self, value, err=0.0):
        self.value = np.asarray(value, np.float64)
        self.err = np.broadcast_to(np.asarray(err, np.float64), self.value.shape).copy()

    @staticmethod
    def const(x):  # a float32 constant: its error is the rounding of the decimal
        return Bounded(x, abs(float(np.float32(x)) - x))

    @staticmethod
    def rounded(value, err, roundings=1):
        return Bounded(value, err + roundings * EPS32 * (np.abs(value) + err))

    def __add__(self, o):
        o = lift(o)
        return Bounded.rounded(self.value + o.value, self.err + o.err)

    def __sub__(self, o):
        o = lift(o)
        return Bounded.rounded(self.value - o.value, self.err + o.err)

    def __rsub__(self, o):
        return lift(o) - self

    def __mul__(self, o):
        o = lift(o)
        return Bounded.rounded(self.value * o.value, np.abs(o.value) * self.err
                               + np.abs(self.value) * o.err + self.err * o.err)

    def __truediv__(self, o):
        o = lift(o)
        lower = np.abs(o.value) - o.err
        assert (lower > 0).all(), "divisor not bounded away from 0"
        q = self.value / o.value
        return Bounded.rounded(q, (self.err + np.abs(q) * o.err) / lower)

    def __rtruediv__(self, o):
        return lift(o) / self

    def sqrt(self):
        root = np.sqrt(self.value)
        with np.errstate(divide="ignore", invalid="ignore"):
            by_slope = np.where(root > 0, self.err / root, np.inf)
        return Bounded.rounded(root, np.minimum(by_slope, np.sqrt(self.err)), roundings=2)

    def clip(self, lo, hi):  # exact and 1-Lipschitz; 0 error where both runs surely clip
        sure = (self.value - self.err > hi) | (self.value + self.err < lo)
        return Bounded(np.clip(self.value, lo, hi), np.where(sure, 0.0, self.err))

    def ravel(self):
        return Bounded(self.value.ravel(), self.err.ravel())

    def minimum(self, o):
        o = lift(o)
        return Bounded(np.minimum(self.value, o.value), np.maximum(self.err, o.err))


def lift(x):
    return x if isinstance(x, Bounded) else Bounded(x)


def dot(a, x, terms):
    """A @ x for an exact float32 matrix A: n-term sums within n EPS32 |A||x|, in any order."""
    a = np.asarray(a, np.float64)
    gamma = terms * EPS32 / (1 - terms * EPS32)
    return Bounded(a @ x.value, np.abs(a) @ x.err + gamma * np.abs(a) @ (np.abs(x.value) + x.err))


def within(got, ref, what=""):
    """|got - ref.value| <= 2 * ref.err entry by entry (2: the safety factor explained above)."""
    gap = np.abs(np.asarray(got, np.float64) - ref.value)
    bound = 2 * ref.err
    worst = np.unravel_index(np.argmax(gap - bound), gap.shape) if gap.shape else ()
    assert (gap <= bound).all(), (f"{what}: |{np.asarray(got)[worst]} - {ref.value[worst]}| = "
                                  f"{gap[worst]:.3g} > derived bound {bound[worst]:.3g} at {worst}")


def np_grad(w):
    """(2/16) X^T (Xw - T), as TensorFlow's gradient of the mean squared error computes it."""
    r = dot(X, lift(w), terms=3) - T
    return dot(X.T, r * (2.0 / len(X)), terms=len(X))


def np_clip_global_norm(g, c):
    # tf.clip_by_global_norm: g * (c * min(1 / ||g||, 1 / c)), ||g|| = sqrt(sum g^2).
    norm = dot(np.ones((1, g.value.size)), (g * g).ravel(), terms=g.value.size).sqrt()
    return g * ((1.0 / norm).minimum(1.0 / c) * c)


def np_adam(grads_fn, steps, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    """Adam as ApplyAdam computes it, with beta powers kept in float32 variables."""
    lr, b1, b2, eps = (Bounded.const(c) for c in (lr, b1, b2, eps))
    w, m, v = Bounded(np.zeros(3)), Bounded(np.zeros(3)), Bounded(np.zeros(3))
    b1_power, b2_power = b1, b2
    for _ in range(steps):
        g = grads_fn(w)
        alpha = lr * (1.0 - b2_power).sqrt() / (1.0 - b1_power)
        m = m + (g - m) * (1.0 - b1)
        v = v + (g * g - v) * (1.0 - b2)
        w = w - m * alpha / (v.sqrt() + eps)
        b1_power, b2_power = b1_power * b1, b2_power * b2
    return w, m, v


def np_momentum(grads_fn, steps, lr=0.01, mu=0.9):
    """Momentum as ApplyMomentum computes it: a := a*mu + g; w := w - a*lr."""
    lr, mu = Bounded.const(lr), Bounded.const(mu)
    w, a = Bounded(np.zeros(3)), Bounded(np.zeros(3))
    for _ in range(steps):
        a = a * mu + grads_fn(w)
        w = w - a * lr
    return w, a


def test_adam_slots_accumulate_the_clipped_gradients():
    got = train(V1.train.AdamOptimizer(0.1), [ms.clip_by_global_norm(1.0)], steps=3, runs=2)
    w, m, v = np_adam(lambda w: np_clip_global_norm(np_grad(w), 1.0), 6)
    # Each within its derived bound (was rtol=1e-4 with atol 1e-7 / 1e-9 / 1e-6: tighter than
    # the derivation allows on the third entry, whose gradient cancels, and on the 1 - beta2^t
    # of the bias correction, which cancels to ~1e-3 and so magnifies beta2_power's roundings).
    # The bounds are wide here (w: 1e-3, 5e-3, 3e-2) and that is the arithmetic, not a choice:
    # an Adam step is scale-free per entry, so a gap d in g_3 (|g_3| ~ 0.004) moves w_3's step
    # by ~lr d / |g_3|, and the Hessian couples w_3 back into every gradient entry.
    within(got["w/Adam"], m, "m")
    within(got["w/Adam_1"], v, "v")
    within(got["w"], w, "w")
    _, raw_m, _ = np_adam(np_grad, 6)
    assert np.abs(got["w/Adam"] - raw_m.value).max() > 100 * np.abs(got["w/Adam"] - m.value).max() + 1e-3


def test_momentum_accumulator_holds_the_clipped_gradients():
    got = train(V1.train.MomentumOptimizer(0.01, 0.9), [ms.clip_by_value(-0.5, 0.5)], steps=2, runs=3)
    w, a = np_momentum(lambda w: np_grad(w).clip(-0.5, 0.5), 6)
    # Derived bounds (was rtol=1e-5: tighter than the derivation allows on the unclipped third
    # entry, whose gradient cancels).
    within(got["w/Momentum"], a, "accumulator")
    within(got["w"], w, "w")
    _, raw_a = np_momentum(np_grad, 6)
    assert np.abs(got["w/Momentum"] - raw_a.value).max() > 1.0


def test_transforms_apply_in_order():
    # scale then clip caps at 0.5; clip then scale would reach 5 * 0.5 = 2.5.
    got = train(V1.train.GradientDescentOptimizer(1.0), [ms.scale(5.0), ms.clip_by_value(-0.5, 0.5)],
                steps=1, runs=1)
    # One step, w = 0 - 1.0 * clip(5 g): the clipped entries are exact, the third carries the
    # derived bound of its cancelling gradient (was rtol=1e-4: tighter than that allows).
    within(got["w"], 0.0 - (np_grad(np.zeros(3)) * 5.0).clip(-0.5, 0.5) * 1.0, "w")


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
    # The same float32 operations as the kernels: the summed rows are small integers (exact in
    # any order), clipping is exact, then fl(EMB0 - fl(0.1f * g)) in ApplyGradientDescent, in
    # scatter_sub, and here (float32 arrays; the Python float 0.1 becomes 0.1f): bitwise.
    want = EMB0 - 0.1 * np.clip(np_dense_grad(), -4.0, 4.0)
    assert want.dtype == np.float32 and got.tobytes() == want.tobytes()
    assert np.abs(got - EMB0).max() <= 0.1 * 4.0 + 1e-6  # the row moved by the cap, not 3 x 3
    np.testing.assert_array_equal(got[[1, 2, 4]], EMB0[[1, 2, 4]])  # untouched rows stay


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_clip_by_global_norm_uses_the_summed_rows(sparse):
    got = embedding_update(ms.clip_by_global_norm(2.0), sparse=sparse)
    g = Bounded(np_dense_grad())  # small integers: exact
    want = EMB0 - np_clip_global_norm(g, 2.0) * Bounded.const(0.1)
    within(got, want)  # the derived bound (was rtol=1e-6: tighter than it on the small entries)
    # The step's norm is lr * 2 = 0.2. Its float32 computation here: got - EMB0 rounds once per
    # entry (u|d|), the norm of 10 entries (squares, a 10-term sum, sqrt) within 13u relative;
    # with the derived bound on got: |norm - 0.2| <= 2 ||err||_2 + 14u * 0.2 (was rel=1e-5).
    assert np.linalg.norm(got - EMB0) == pytest.approx(
        0.1 * 2.0, rel=0, abs=2 * np.linalg.norm(want.err) + 14 * EPS32 * 0.2)


@pytest.mark.parametrize("transform", [ms.clip_by_norm(1.5), ms.scale(-0.5), ms.add_noise(0.3, seed=4)],
                         ids=lambda t: t.__name__)
def test_dense_and_sparse_agree_on_the_touched_rows(transform):
    sparse = embedding_update(transform, sparse=True)
    dense = embedding_update(transform, sparse=False)
    touched = [0, 3]
    # The same operations on the same values: the summed sparse rows equal the dense gradient's
    # rows exactly (small integers), the dense norm only adds zero rows, the noise of a sparse
    # gradient is the dense draw's rows, and scatter_sub / ApplyGradientDescent both compute
    # fl(w - fl(g * lr)): bitwise (was rtol=1e-6).
    assert sparse[touched].tobytes() == dense[touched].tobytes()
    np.testing.assert_array_equal(sparse[[1, 2, 4]], EMB0[[1, 2, 4]])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_transform_written_with_tf_clip_by_global_norm_is_a_single_steps(optimizer):
    """Issue 28: a transform the user writes with tf.clip_by_global_norm (whose norm counts
    each repeated embedding row) came out 4.77e-7 off the canonical single step when the
    clip bites, because the rows were summed before any transform. The transforms now
    see compute_gradients' own gradients: bitwise with single steps that clip by hand."""
    make = {"sgd": lambda: V1.train.GradientDescentOptimizer(0.1),
            "adam": lambda: V1.train.AdamOptimizer(0.1)}[optimizer]

    def clip(grads_and_vars, step=None):  # as a user writes it between compute and apply
        clipped, _ = tf.clip_by_global_norm([g for g, _ in grads_and_vars], 2.0)
        return list(zip(clipped, [v for _, v in grads_and_vars]))

    with tf.Graph().as_default():  # the canonical single step, 6 runs
        opt = make()
        train = opt.apply_gradients(clip(opt.compute_gradients(embedding_loss(True))))
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for _ in range(6):
                sess.run(train)
            want = {v.op.name: sess.run(v) for v in V1.global_variables()}
    with tf.Graph().as_default():
        unrolled = ms.unroll(lambda: embedding_loss(True), make(), 3, grad_transforms=[clip])
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for _ in range(2):
                sess.run(unrolled.train_op)
            got = {v.op.name: sess.run(v) for v in V1.global_variables()}
    # The clip bites: the gradient's rows (the loss is linear: COEF at every step) have the
    # global norm sqrt(35) unsummed, sqrt(95) summed, both above 2.0, and differ: the old
    # dedupe changed the scale, which is what this test catches.
    assert np.sqrt((COEF ** 2).sum()) > 2.0 and np.sqrt((np_dense_grad() ** 2).sum()) > 2.0
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


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
    # Statistical bounds at 5 standard errors (a false alarm for a fresh seed: 6e-7 per check):
    # the mean of n = 2000 draws of N(1, 2^2) has standard error 2 / sqrt(n) (was abs=0.15,
    # 3.4 se); a sample standard deviation, relative standard error 1 / sqrt(2(n - 1)) (was
    # rel=0.1, 6.3 se). The draws are stateless and seeded, so the check is deterministic.
    n = 2000
    assert early.mean() == pytest.approx(1.0, abs=5 * 2.0 / np.sqrt(n))  # 5 se of a mean
    assert early.std() == pytest.approx(2.0, rel=5 / np.sqrt(2 * (n - 1)))  # 5 se of a std
    assert late.std() == pytest.approx(2.0 / np.sqrt(100.0), rel=5 / np.sqrt(2 * (n - 1)))  # 5 se


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
