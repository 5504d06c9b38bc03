"""Property: for any small model, optimizer, N, mode and transform chain, fused runs equal
plain single steps (N x runs sess.run calls of compute -> transform -> apply, written here
without ms.unroll): bitwise, or within the XLA tolerance."""

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from tensorflow.core.protobuf import rewriter_config_pb2

import multistep as ms

V1 = tf.compat.v1
OPTIMIZERS = {
    "sgd": lambda: V1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: V1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
    "adam": lambda: V1.train.AdamOptimizer(0.05),
    "rmsprop": lambda: V1.train.RMSPropOptimizer(0.02, centered=True),
    "adagrad": lambda: V1.train.AdagradOptimizer(0.1),
    "adadelta": lambda: V1.train.AdadeltaOptimizer(1.0),
    "ftrl": lambda: V1.train.FtrlOptimizer(0.1),
    "compact_sgd": lambda: ms.RuleOptimizer(ms.rules.compact_sgd(5.0), learning_rate=0.1),
}
TRANSFORMS = {
    "clip_value": lambda: ms.clip_by_value(-0.2, 0.2),
    "clip_norm": lambda: ms.clip_by_norm(0.5),
    "clip_global_norm": lambda: ms.clip_by_global_norm(0.3),
    "noise": lambda: ms.add_noise(0.02, decay=0.55, seed=5),
    "scale": lambda: ms.scale(0.7),
}
RUNS, BATCH, FEATURES = 2, 6, 3
# A rule's update is graph arithmetic, which Grappler may regroup differently in the N-step
# graph than in the single-step one (found here: (g * 0.7) * 0.1 folded to g * 0.07 in one graph
# only). Constant folding and the arithmetic optimizer are the two passes that regroup products
# (see test_rules.py, NO_REASSOCIATION); with both off in both sessions the graphs round alike.
NO_REASSOCIATION = V1.ConfigProto()
NO_REASSOCIATION.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
NO_REASSOCIATION.graph_options.rewrite_options.arithmetic_optimization = (
    rewriter_config_pb2.RewriterConfig.OFF)
# XLA rounds differently at every step (docs/guides/unroll.md, `xla`): it fuses element-wise chains (FMAs),
# sums the reductions here (<= BATCH * 4 = 24 terms) in its own order (within 24u of the summed
# magnitudes, u = 2^-24) and evaluates tanh/exp/sqrt with its own approximations: a few tens of
# ulps per step from the same state. What that becomes after up to 16 steps depends on how the
# drawn model and optimizer amplify a perturbation, and over hypothesis-drawn models that has no
# useful a-priori bound (nothing caps lr * L for a drawn model, and Adam/RMSProp/Adagrad steps
# are scale-free, so a gradient entry near 0 turns an ulp into a fraction of lr). So unlike
# every other bound in tests/, these two are NOT derived: they are the stated acceptance
# threshold of this property (10x the ~1e-4 relative gap seen over these examples), a finding
# to revisit, not a rounding bound; the derived XLA bound, for a fixed problem, is
# test_modes.py's xla_atol.
XLA_RTOL, XLA_ATOL = 1e-3, 1e-4


def make_loss(widths, seed):
    rng = np.random.RandomState(seed)
    shapes = list(zip([FEATURES] + widths[:-1], widths))
    init = [rng.uniform(0.1, 1.0, size=s).astype(np.float32) for s in shapes]

    def loss_fn(x, y):
        h = x
        for i, w0 in enumerate(init):
            h = tf.matmul(h, V1.get_variable(f"layer{i}", initializer=w0))
            if i < len(init) - 1:
                h = tf.tanh(h)
        return tf.reduce_mean(tf.square(tf.reduce_sum(h, axis=1) - y))
    return loss_fn


def values(sess):
    return {v.op.name: sess.run(v) for v in V1.global_variables()}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(widths=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       steps=st.integers(1, 8),
       mode=st.sampled_from(["unrolled", "while_loop"]),
       per_step=st.booleans(),
       chain=st.lists(st.sampled_from(sorted(TRANSFORMS)), max_size=3),
       xla=st.booleans(),
       seed=st.integers(0, 1000))
def test_fused_equals_single_steps(widths, optimizer, steps, mode, per_step, chain, xla, seed):
    # XLA (which compiles step 1 too) draws other random numbers than TensorFlow (ms.unroll
    # warns): no reference to match.
    assume(not (xla and "noise" in chain))
    # compact_sgd's wrap-around amplifies XLA's per-step rounding within a few steps (0.006
    # after 8 steps, found here): no tolerance would say anything.
    assume(not (xla and optimizer == "compact_sgd"))
    rng = np.random.RandomState(seed)
    data_x = rng.randn(steps * RUNS, BATCH, FEATURES).astype(np.float32)
    data_y = rng.randn(steps * RUNS, BATCH).astype(np.float32)
    loss_fn = make_loss(widths, seed)
    config = NO_REASSOCIATION if optimizer == "compact_sgd" else None

    with tf.Graph().as_default():  # the reference: one step per sess.run
        gs = V1.train.get_or_create_global_step()
        x = V1.placeholder(tf.float32, [BATCH, FEATURES])
        y = V1.placeholder(tf.float32, [BATCH])
        opt = OPTIMIZERS[optimizer]()
        grads = opt.compute_gradients(loss_fn(x, y))
        for name in chain:
            grads = TRANSFORMS[name]()(grads, gs.read_value())
        train = opt.apply_gradients(grads, global_step=gs)
        with V1.Session(config=config) as sess:
            sess.run(V1.global_variables_initializer())
            want = []
            for j in range(steps * RUNS):
                k = j if per_step else 0
                sess.run(train, {x: data_x[k], y: data_y[k]})
                if (j + 1) % steps == 0:
                    want.append(values(sess))

    with tf.Graph().as_default():  # fused
        gs = V1.train.get_or_create_global_step()
        if per_step:
            xs = V1.placeholder(tf.float32, [steps, BATCH, FEATURES])
            ys = V1.placeholder(tf.float32, [steps, BATCH])
            feeds = [{xs: data_x[r * steps:(r + 1) * steps], ys: data_y[r * steps:(r + 1) * steps]}
                     for r in range(RUNS)]
            fused = ms.unroll(loss_fn, OPTIMIZERS[optimizer](), steps, inputs=(xs, ys), global_step=gs,
                              grad_transforms=[TRANSFORMS[n]() for n in chain], mode=mode, xla=xla)
        else:
            feeds = [{}] * RUNS
            fused = ms.unroll(lambda: loss_fn(data_x[0], data_y[0]), OPTIMIZERS[optimizer](), steps,
                              global_step=gs, grad_transforms=[TRANSFORMS[n]() for n in chain],
                              mode=mode, xla=xla)
        with V1.Session(config=config) as sess:
            sess.run(V1.global_variables_initializer())
            got = []
            for feed in feeds:
                fused.run(sess, feed)
                got.append(values(sess))

    for run, (g, w) in enumerate(zip(got, want), start=1):
        assert sorted(g) == sorted(w)
        for name in w:
            if xla:  # the stated XLA threshold above (not derived); step 1 is compiled too
                np.testing.assert_allclose(g[name], w[name], rtol=XLA_RTOL, atol=XLA_ATOL,
                                           err_msg=f"{name} after run {run}")
            else:
                assert g[name].tobytes() == w[name].tobytes(), f"{name} after run {run}"
