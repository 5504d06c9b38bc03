"""RuleOptimizer and the built-in rules, against TensorFlow's own optimizers and numpy."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import multistep as ms

V1 = tf.compat.v1
EPS32 = 2.0 ** -24  # float32 unit roundoff: one rounding moves a value by at most EPS32 relative
rng = np.random.RandomState(3)
W0 = rng.uniform(0.0, 4.0, size=(5, 2)).astype(np.float32)
X = rng.randn(4, 5).astype(np.float32)
IDS = np.array([1, 1, 4, 1], np.int32)  # row 1 looked up three times
COEF = rng.randn(4, 2).astype(np.float32)

# Session configurations. MomentumOptimizer's dense kernel (ApplyMomentum, training_ops.cc)
# computes the Nesterov step as  var -= grad * lr + (accum * momentum) * lr,  its sparse kernel
# (SparseApplyMomentum) as  var -= lr * grad + (lr * momentum) * accum.  The rule's graph spells
# the dense order, but Grappler rewrites its (a * 0.9) * 0.05 into a * 0.045, 0.045 being
# fl(0.9 * 0.05): the sparse kernel's order, one ulp away from the dense one now and then. Two
# Grappler optimizers do that rewrite, each on its own: constant folding (pushes the constants
# together and folds them) and the arithmetic optimizer (regroups the product so that the two
# scalars meet; the runtime's own constant folding then folds them). Found by turning Grappler's
# optimizers off one at a time (no single one restores bitwise equality), then two at a time
# (only constant_folding + arithmetic_optimization does, as does disable_meta_optimizer), and by
# reading the rewritten graphs (RunOptions.output_partition_graphs). oneDNN plays no part: with
# TF_ENABLE_ONEDNN_OPTS=0 and =1 the same comparisons are bitwise and the same ones differ, by
# the same amounts (both graphs take their gradient from the same MatMul; the updates are Eigen
# element-wise kernels). Bitwise equality also needs each kernel to round every product and sum
# on its own: the x86 wheels compile Eigen's element-wise kernels without FMA (the start-up line
# lists FMA among the instructions not used "in other operations"); a build that contracts them
# into FMAs would differ from any graph of Mul and Add.
NO_REASSOCIATION = V1.ConfigProto()
NO_REASSOCIATION.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
NO_REASSOCIATION.graph_options.rewrite_options.arithmetic_optimization = (
    rewriter_config_pb2.RewriterConfig.OFF)
DEFAULT = V1.ConfigProto()
CONFIGS = {"default": DEFAULT, "no_reassociation": NO_REASSOCIATION}


def loss_of(w, sparse):
    if sparse:
        return tf.reduce_sum(tf.gather(w, IDS) * COEF)                  # IndexedSlices gradient
    return tf.reduce_sum(tf.square(tf.matmul(X, w) - 1.0))              # dense gradient


def run_minimize(optimizer_fn, *, sparse, use_resource, steps=4, config=DEFAULT):
    """Plain minimize, one step per sess.run; the weights and every slot after each step."""
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=W0, use_resource=use_resource)
        gs = V1.train.get_or_create_global_step()
        train = optimizer_fn().minimize(loss_of(w, sparse), global_step=gs)
        with V1.Session(config=config) as sess:
            sess.run(V1.global_variables_initializer())
            history = []
            for _ in range(steps):
                sess.run(train)
                history.append({v.op.name: sess.run(v) for v in V1.global_variables()})
            return history


def assert_within(actual, desired, bound, what):
    """|actual - desired| <= bound, entry by entry (bound: a number or an array like them)."""
    actual, desired = np.broadcast_arrays(np.asarray(actual, np.float64), np.asarray(desired, np.float64))
    gap = np.abs(actual - desired)
    excess = gap - bound
    worst = np.unravel_index(np.argmax(excess), gap.shape) if gap.shape else ()
    assert (excess <= 0).all(), (f"{what}: |{actual[worst]} - {desired[worst]}| = {gap[worst]:.3g} "
                                 f"> bound {np.broadcast_to(bound, gap.shape)[worst]:.3g} at {worst}")


def abs_row_sums():
    """sum |c_i| over the COEF rows of each index: the magnitude of a summed sparse gradient row."""
    total = np.zeros(W0.shape)
    np.add.at(total, IDS, np.abs(COEF.astype(np.float64)))
    return total


CASES = [(s, r) for s in (False, True) for r in (True, False)]
CASE_IDS = [f"{'sparse' if s else 'dense'}-{'resource' if r else 'ref'}" for s, r in CASES]


def sparse_sgd_gap_bound(history, lr):
    """After each step: a bound on |w_rule - w_gd| per entry, for the sparse SGD comparison.

    GradientDescentOptimizer subtracts the rows of a repeated index one at a time,
    w - lr*c1 - lr*c2 - lr*c3 (3 products, 3 subtractions); the rule sums them first,
    w - lr*(c1 + c2 + c3) (2 additions, 1 product, 1 subtraction). Each rounding is at most
    EPS32 relative to a partial result no larger than |w| + lr*sum|c_i|, so either is within
    4*EPS32*(|w| + lr*sum|c_i|) of the exact step: two runs differ by at most twice that per
    step. The loss is linear in w, so the gradient does not depend on w: the gaps of the steps
    add up with nothing amplifying them. Safety factor 2: the analysis is first order in EPS32
    (dropped terms are ~1e-7 of the bound) and takes |w| from one run for both (they differ by
    the bound itself, ~1e-6 relative); 2 covers both many times over."""
    bounds, total, before = [], np.zeros(W0.shape), W0.astype(np.float64)
    for values in history:
        total = total + 2 * 4 * EPS32 * (np.abs(before) + lr * abs_row_sums())
        bounds.append(2 * total)
        before = values["w"].astype(np.float64)
    return bounds


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("sparse,use_resource", CASES, ids=CASE_IDS)
def test_sgd_rule_equals_gradient_descent_optimizer(sparse, use_resource, config):
    got = run_minimize(lambda: ms.RuleOptimizer(ms.rules.sgd(), learning_rate=0.05),
                       sparse=sparse, use_resource=use_resource, config=CONFIGS[config])
    want = run_minimize(lambda: V1.train.GradientDescentOptimizer(0.05),
                        sparse=sparse, use_resource=use_resource, config=CONFIGS[config])
    bounds = sparse_sgd_gap_bound(want, 0.05) if sparse else None
    for step, (g, w) in enumerate(zip(got, want), start=1):
        if sparse:
            # Not the same arithmetic (a repeated index: rows subtracted one by one, or summed
            # first), so no configuration makes it bitwise: the derived bound above.
            assert_within(g["w"], w["w"], bounds[step - 1], f"step {step}")
        else:
            # w - g * lr, one product and one subtraction in both: nothing to rewrite.
            assert g["w"].tobytes() == w["w"].tobytes(), f"diverged at step {step}"
        assert g["global_step"] == w["global_step"] == step
    assert not np.array_equal(got[-1]["w"], W0)


def nesterov_gap_bound(history, *, sparse, lr=0.05, mu=0.9):
    """After each step: bounds on max|w - w'| and max|a - a'| between two float32 runs of the
    Nesterov step whose graphs may round differently. u = EPS32; a run computes, with g = grad(w):

        a' = a*mu + g                  2 roundings: within 2u(mu|a| + |g|)
        s  = g*lr + a'*mu*lr           3 roundings in either grouping, (a'*mu)*lr or a'*fl(mu*lr):
                                       within 3u(lr|g| + lr*mu|a'|)
        w' = w - s                     1 rounding: within u|w'|

    and its gradient with an error E_g of its own. Dense: r = Xw - 1 is a 5-term dot product and
    a subtraction, within 6u(|X||w| + 1); 2r is exact; g = X^T(2r) a 4-term one: in any order,
    with or without FMA (Higham, Accuracy and Stability of Numerical Algorithms, 3.1),
    E_g <= 10u * 2|X|^T(|X||w| + 1), which is large where g cancels. Sparse: a row is <= 3 rows of
    COEF summed, E_g <= 2u sum|c_i|. So each run's step is the exact step F plus a residual
    r = (r_w, r_a), |r_a| <= 2u(mu|a| + |g|) + E_g, |r_w| <= u|w'| + 3u lr(|g| + mu|a'|) + lr E_g
    + lr mu |r_a|. F is affine in (w, a): g = Hw - 2X^T 1 per column of w, H = 2X^T X (sparse:
    g is constant, H = 0). So the difference d_k of the two runs obeys d_k = J d_{k-1} +
    r_k - r'_k exactly, with J = [[I - lr(1 + mu)H, -lr mu^2 I], [H, mu I]], and
    |d_t| <= sum_k |J^(t-k)| (|r_k| + |r'_k|); the conditioning of the dense loss is in J
    (||J||_inf = 25 here: a gap in w shows up 25 times larger in the next gradient). Safety
    factor 2: the analysis is first order in u (the dropped terms are ~(20u)^2, 1e-11 relative)
    and evaluates the magnitudes on one run for both (they differ by the bound itself, < 1e-4
    relative); 2 covers both with a wide margin."""
    n = W0.shape[0]
    x = X.astype(np.float64)
    hessian = np.zeros((n, n)) if sparse else 2 * x.T @ x
    jacobian = np.block([[np.eye(n) - lr * (1 + mu) * hessian, -lr * mu * mu * np.eye(n)],
                         [hessian, mu * np.eye(n)]])
    w, a = W0.astype(np.float64), np.zeros(W0.shape)
    residuals, bounds = [], []
    for values in history:
        if sparse:
            g, g_err = np_sparse_grad(w), 2 * EPS32 * abs_row_sums()
        else:
            g, g_err = np_dense_grad(w), 10 * EPS32 * 2 * np.abs(x).T @ (np.abs(x) @ np.abs(w) + 1)
        w_new, a_new = values["w"].astype(np.float64), values["w/Momentum"].astype(np.float64)
        r_a = 2 * EPS32 * (mu * np.abs(a) + np.abs(g)) + g_err
        r_w = (EPS32 * np.abs(w_new) + 3 * EPS32 * lr * (np.abs(g) + mu * np.abs(a_new))
               + lr * g_err + lr * mu * r_a)
        residuals.append((r_w.max(), r_a.max()))
        gap_w = gap_a = 0.0
        for k, (res_w, res_a) in enumerate(residuals):
            power = np.abs(np.linalg.matrix_power(jacobian, len(residuals) - 1 - k))
            gap_w += power[:n, :n].sum(1).max() * 2 * res_w + power[:n, n:].sum(1).max() * 2 * res_a
            gap_a += power[n:, :n].sum(1).max() * 2 * res_w + power[n:, n:].sum(1).max() * 2 * res_a
        bounds.append((2 * gap_w, 2 * gap_a))
        w, a = w_new, a_new
    return bounds


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("sparse,use_resource", CASES, ids=CASE_IDS)
def test_momentum_rule_equals_momentum_optimizer(sparse, use_resource, nesterov, config):
    got = run_minimize(lambda: ms.RuleOptimizer(ms.rules.momentum(0.9, use_nesterov=nesterov),
                                                learning_rate=0.05, slots=["momentum"]),
                       sparse=sparse, use_resource=use_resource, config=CONFIGS[config])
    want = run_minimize(lambda: V1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=nesterov),
                        sparse=sparse, use_resource=use_resource, config=CONFIGS[config])
    # Plain momentum (a' = a*mu + g, w - a'*lr) has nothing to regroup: bitwise everywhere. The
    # Nesterov step is bitwise where the rule's graph keeps the kernel's grouping (see
    # NO_REASSOCIATION): dense without the rewrite, sparse with it; elsewhere the derived bound.
    bitwise = not nesterov or config == ("default" if sparse else "no_reassociation")
    bounds = nesterov_gap_bound(want, sparse=sparse)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        if bitwise:
            assert g["w"].tobytes() == w["w"].tobytes(), f"weights diverged at step {step}"
            assert g["w/Rule/momentum"].tobytes() == w["w/Momentum"].tobytes(), f"slot diverged at step {step}"
        else:
            bound_w, bound_a = bounds[step - 1]
            assert_within(g["w"], w["w"], bound_w, f"weights at step {step}")
            assert_within(g["w/Rule/momentum"], w["w/Momentum"], bound_a, f"slot at step {step}")
    if not bitwise:
        # The bound still has teeth: it is under a thousandth of how far w moved (dense: 1.7e-4
        # against 2.7), so a rule off by any sizeable part of a step fails.
        assert bounds[-1][0] < 1e-3 * np.abs(got[-1]["w"] - W0).max()


def np_compact_sgd(w, grad_fn, lr, modulus, steps):
    w = np.asarray(w, np.float64)
    for _ in range(steps):
        w = np.mod(w - lr * grad_fn(w), modulus)
    return w


def np_dense_grad(w):
    return 2.0 * X.T @ (X @ w - 1.0)


def np_sparse_grad(w):
    g = np.zeros_like(w)
    np.add.at(g, IDS, COEF)  # repeated indices summed
    return g


def compact_sgd_step_bound(w, sparse, lr, modulus):
    """A bound, per entry and on the circle, on |TF step - exact step| from the same state w.

    TF computes floormod(w - g*lr, B) in float32: its gradient is within E_g of the exact one
    (dense 10u * 2|X|^T(|X||w| + 1), sparse 2u sum|c_i|, as derived in nesterov_gap_bound);
    lr = fl(0.3) is within u*lr of 0.3 and the product rounds once: 2u*lr|g|; the subtraction
    rounds once: u(|w| + lr|g|); floormod is fmod (exact) and, when the signs differ, one
    addition of B: u*B. floormod is 1-Lipschitz on the circle, so the errors pass through.
    Safety factor 2: first order in u, and the float64 reference's own error (2^-53 relative,
    2^-29 of these terms) is left out; 2 covers both."""
    w = np.asarray(w, np.float64)
    if sparse:
        g, g_err = np_sparse_grad(w), 2 * EPS32 * abs_row_sums()
    else:
        x = np.abs(X.astype(np.float64))
        g, g_err = np_dense_grad(w), 10 * EPS32 * 2 * x.T @ (x @ np.abs(w) + 1)
    return 2 * (lr * g_err + 2 * EPS32 * lr * np.abs(g) + EPS32 * (np.abs(w) + lr * np.abs(g))
                + EPS32 * modulus)


@pytest.mark.parametrize("sparse,use_resource", CASES, ids=CASE_IDS)
def test_compact_sgd_matches_numpy_and_stays_in_range(sparse, use_resource):
    modulus, lr = 4.0, 0.3
    got = run_minimize(lambda: ms.RuleOptimizer(ms.rules.compact_sgd(modulus), learning_rate=lr),
                       sparse=sparse, use_resource=use_resource, steps=6)
    grad_fn = np_sparse_grad if sparse else np_dense_grad
    previous = W0
    for step, values in enumerate(got, start=1):
        # One numpy step from the previous TF state (the wrapped dynamics amplify rounding).
        want = np_compact_sgd(previous, grad_fn, lr, modulus, 1)
        # floormod near 0 / B can wrap either way under float32 rounding: compare on the circle,
        # within the derived one-step bound (was 1e-5 * B = 4e-5 for every entry: tighter than
        # derived on some dense entries, up to 4.3e-5, where |X|^T(|X||w| + 1) is large).
        gap = np.abs(values["w"] - want)
        assert_within(np.minimum(gap, modulus - gap), 0.0,
                      compact_sgd_step_bound(previous, sparse, lr, modulus), f"step {step}")
        assert values["w"].min() >= 0.0 and values["w"].max() < modulus
        previous = values["w"]
    if sparse:
        np.testing.assert_array_equal(got[-1]["w"][[0, 2, 3]], W0[[0, 2, 3]])  # untouched rows
    else:
        assert np.abs(np_dense_grad(W0) * lr).max() > modulus  # steps big enough to wrap


def test_schedule_is_evaluated_at_every_inner_step():
    def build(steps):
        w = V1.get_variable("w", initializer=np.float32(3.0))
        gs = V1.train.get_or_create_global_step()
        lr = lambda: V1.train.exponential_decay(0.1, gs, 1, 0.5)  # noqa: E731  halves every step
        opt = ms.RuleOptimizer(ms.rules.sgd(), learning_rate=lr)
        return ms.unroll(lambda: w * w, opt, steps, global_step=gs), {}

    report = ms.verify(build, steps=4, runs=2)
    assert report.ok and report.bitwise
    w = 3.0
    for t in range(8):
        w -= 0.1 * 0.5 ** t * 2 * w
    # float32 against float64. Per step: 0.1 -> float32 (u), pow(0.5, t) (<= 1 ulp, 2u), the
    # product 0.1 * 0.5^t (u), lr * 2w (u; 2w is exact), w - lr*2w (u): <= 6u relative to w
    # (over-counted: the update is <= 0.2w). w -> w(1 - 2 lr_t) is linear, so relative errors
    # add over the 8 steps: rel <= 8 * 6u = 48u (~2.9e-6; was 1e-5, looser than derived).
    assert report.final_values["w"] == pytest.approx(w, rel=8 * 6 * EPS32)


RULES = {
    "sgd": lambda: ms.RuleOptimizer(ms.rules.sgd(), learning_rate=0.05),
    "momentum": lambda: ms.RuleOptimizer(ms.rules.momentum(0.9), learning_rate=0.05, slots=["momentum"]),
    "compact_sgd": lambda: ms.RuleOptimizer(ms.rules.compact_sgd(4.0), learning_rate=0.3),
    "compact_sgd_noise": lambda: ms.RuleOptimizer(
        ms.rules.compact_sgd(4.0, noise_mean=0.01, noise_stddev=0.05, seed=5), learning_rate=0.3),
}


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("steps", [1, 3, 7])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_verify_passes_bitwise_with_each_rule(rule, steps, sparse):
    def build(n):
        def loss_fn():
            return loss_of(V1.get_variable("w", initializer=W0), sparse)

        return ms.unroll(loss_fn, RULES[rule](), n, global_step=V1.train.get_or_create_global_step()), {}

    report = ms.verify(build, steps=steps, runs=3)
    assert report.ok and report.bitwise, str(report)


def test_noisy_compact_sgd_differs_from_noiseless_and_stays_in_range():
    noisy = run_minimize(RULES["compact_sgd_noise"], sparse=False, use_resource=True)[-1]["w"]
    plain = run_minimize(RULES["compact_sgd"], sparse=False, use_resource=True)[-1]["w"]
    assert not np.array_equal(noisy, plain)
    assert noisy.min() >= 0.0 and noisy.max() < 4.0


# Bad input names the rule.

def _apply(update_fn, slots=()):
    with tf.Graph().as_default():
        w = tf.Variable(tf.ones([3, 2]), name="w")
        ms.RuleOptimizer(update_fn, learning_rate=0.1, slots=slots).minimize(tf.reduce_sum(w))


def test_update_fn_returning_the_wrong_shape():
    def squash(var, grad, lr, slots, step):
        return tf.reduce_sum(var, axis=0), {}

    with pytest.raises(ValueError, match=r"RuleOptimizer squash \(variable 'w'\): new value has shape \(2,\)"):
        _apply(squash)


def test_update_fn_returning_the_wrong_dtype():
    def to_double(var, grad, lr, slots, step):
        return tf.cast(var, tf.float64), {}

    with pytest.raises(TypeError, match="RuleOptimizer to_double .*dtype float64, expected float32"):
        _apply(to_double)


def test_update_fn_returning_the_wrong_structure():
    def just_var(var, grad, lr, slots, step):
        return var

    with pytest.raises(TypeError, match=r"RuleOptimizer just_var .*must return \(new_var, new_slots_dict\)"):
        _apply(just_var)


def test_update_fn_forgetting_a_slot():
    def no_slot(var, grad, lr, slots, step):
        return var - lr * grad, {}

    with pytest.raises(ValueError, match=r"RuleOptimizer no_slot .*returned slots \[\], expected \['m'\]"):
        _apply(no_slot, slots=["m"])


def test_noisy_rule_without_global_step():
    with pytest.raises(ValueError, match="compact_sgd.*draws noise keyed on the global step"):
        _apply(ms.rules.compact_sgd(4.0, noise_stddev=0.1))


@pytest.mark.parametrize("make", [lambda: ms.rules.compact_sgd(0.0), lambda: ms.rules.compact_sgd(-2),
                                  lambda: ms.rules.compact_sgd(4.0, noise_stddev=-1.0)])
def test_bad_compact_sgd_arguments(make):
    with pytest.raises(ValueError, match="compact_sgd: "):
        make()


def test_update_fn_must_be_callable():
    with pytest.raises(TypeError, match="update_fn must be callable"):
        ms.RuleOptimizer("sgd", learning_rate=0.1)
