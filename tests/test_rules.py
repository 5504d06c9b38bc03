"""RuleOptimizer and the built-in rules, against TensorFlow's own optimizers and numpy."""

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
rng = np.random.RandomState(3)
W0 = rng.uniform(0.0, 4.0, size=(5, 2)).astype(np.float32)
X = rng.randn(4, 5).astype(np.float32)
IDS = np.array([1, 1, 4, 1], np.int32)  # row 1 looked up three times
COEF = rng.randn(4, 2).astype(np.float32)


def loss_of(w, sparse):
    if sparse:
        return tf.reduce_sum(tf.gather(w, IDS) * COEF)                  # IndexedSlices gradient
    return tf.reduce_sum(tf.square(tf.matmul(X, w) - 1.0))              # dense gradient


def run_minimize(optimizer_fn, *, sparse, use_resource, steps=4):
    """Plain minimize, one step per sess.run; the weights and every slot after each step."""
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=W0, use_resource=use_resource)
        gs = V1.train.get_or_create_global_step()
        train = optimizer_fn().minimize(loss_of(w, sparse), global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            history = []
            for _ in range(steps):
                sess.run(train)
                history.append({v.op.name: sess.run(v) for v in V1.global_variables()})
            return history


CASES = [(s, r) for s in (False, True) for r in (True, False)]
CASE_IDS = [f"{'sparse' if s else 'dense'}-{'resource' if r else 'ref'}" for s, r in CASES]


@pytest.mark.parametrize("sparse,use_resource", CASES, ids=CASE_IDS)
def test_sgd_rule_equals_gradient_descent_optimizer(sparse, use_resource):
    got = run_minimize(lambda: ms.RuleOptimizer(ms.rules.sgd(), learning_rate=0.05),
                       sparse=sparse, use_resource=use_resource)
    want = run_minimize(lambda: V1.train.GradientDescentOptimizer(0.05),
                        sparse=sparse, use_resource=use_resource)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        if sparse:
            # GradientDescentOptimizer adds the rows of a repeated index one at a time;
            # the rule sums them first, like every other v1 optimizer: equal up to rounding.
            np.testing.assert_allclose(g["w"], w["w"], rtol=1e-6, err_msg=f"step {step}")
        else:
            assert g["w"].tobytes() == w["w"].tobytes(), f"diverged at step {step}"
        assert g["global_step"] == w["global_step"] == step
    assert not np.array_equal(got[-1]["w"], W0)


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("sparse,use_resource", CASES, ids=CASE_IDS)
def test_momentum_rule_equals_momentum_optimizer(sparse, use_resource, nesterov):
    got = run_minimize(lambda: ms.RuleOptimizer(ms.rules.momentum(0.9, use_nesterov=nesterov),
                                                learning_rate=0.05, slots=["momentum"]),
                       sparse=sparse, use_resource=use_resource)
    want = run_minimize(lambda: V1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=nesterov),
                        sparse=sparse, use_resource=use_resource)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        if nesterov and not sparse:
            # Grappler's rewrites of the rule's graph change how lr*g + lr*m*a rounds
            # (with its meta-optimizer disabled the two agree bitwise): a few ulps apart.
            np.testing.assert_allclose(g["w"], w["w"], rtol=1e-6, err_msg=f"step {step}")
            np.testing.assert_allclose(g["w/Rule/momentum"], w["w/Momentum"], rtol=1e-5)
            continue
        assert g["w"].tobytes() == w["w"].tobytes(), f"weights diverged at step {step}"
        assert g["w/Rule/momentum"].tobytes() == w["w/Momentum"].tobytes(), f"slot diverged at step {step}"


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
        # floormod near 0 / B can wrap either way under float32 rounding: compare on the circle.
        gap = np.abs(values["w"] - want)
        np.testing.assert_array_less(np.minimum(gap, modulus - gap), 1e-5 * modulus)
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
    assert report.final_values["w"] == pytest.approx(w, rel=1e-5)


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
