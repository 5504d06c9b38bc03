"""Stateful samplers in fused steps: nce_loss and sampled_softmax_loss draw their negative
classes with a stateful candidate sampler, whose draws depend on how many sess.run calls
were made. ms.unroll warns at build naming it and the replacement; ms.verify's DIVERGED
report names it as the suspect; with ms.sampling.log_uniform_candidates keyed on the
global step the fused steps are bitwise the canonical single steps (minimize, one
sess.run a step) with the same sampler."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
VOCAB, DIM, BATCH, SAMPLED = 50, 8, 16, 5
rng = np.random.RandomState(0)
CONTEXT = rng.randint(0, VOCAB, size=(12, BATCH)).astype(np.int64)
LABELS = rng.randint(0, VOCAB, size=(12, BATCH, 1)).astype(np.int64)


def word2vec(loss, stateless):
    """A word2vec-style loss: embeddings, then nce_loss or sampled_softmax_loss."""
    gs = V1.train.get_or_create_global_step()
    emb = V1.get_variable("emb", initializer=np.random.RandomState(1).uniform(
        -1, 1, (VOCAB, DIM)).astype(np.float32))
    weights = V1.get_variable("nce_w", initializer=np.random.RandomState(2).randn(
        VOCAB, DIM).astype(np.float32) * 0.1)
    biases = V1.get_variable("nce_b", initializer=np.zeros(VOCAB, np.float32))
    fn = {"nce": tf.nn.nce_loss, "softmax": tf.nn.sampled_softmax_loss}[loss]

    def loss_fn(x, y):
        sampled = None
        if stateless:
            sampled = ms.sampling.log_uniform_candidates(
                y, SAMPLED, VOCAB, seed=tf.stack([7, tf.cast(gs, tf.int32)]))
        return tf.reduce_mean(fn(weights, biases, y, tf.nn.embedding_lookup(emb, x), SAMPLED,
                                 VOCAB, sampled_values=sampled))
    return loss_fn, gs


def build(loss, stateless):
    def build_fn(steps):
        x = V1.placeholder(tf.int64, [steps, BATCH])
        y = V1.placeholder(tf.int64, [steps, BATCH, 1])
        loss_fn, gs = word2vec(loss, stateless)
        unrolled = ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.5), steps,
                             inputs=(x, y), global_step=gs)
        return unrolled, lambda r: {x: CONTEXT[r * steps:(r + 1) * steps],
                                    y: LABELS[r * steps:(r + 1) * steps]}
    return build_fn


@pytest.mark.parametrize("loss, op", [("nce", "nce_loss/LogUniformCandidateSampler"),
                                      ("softmax", "sampled_softmax_loss/LogUniformCandidateSampler")])
def test_a_stateful_sampler_warns_at_build_and_is_the_suspect_of_a_divergence(loss, op):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ms.verify(build(loss, stateless=False), steps=4, runs=2)
    warning = [w for w in caught if "own stream" in str(w.message)][0]  # a build each
    assert f"'multistep/step/forward/{op}' (LogUniformCandidateSampler)" in str(warning.message)
    assert "ms.sampling.log_uniform_candidates" in str(warning.message)
    assert not report.ok
    assert (f"suspect: the steps draw with stateful random ops ('multistep/step_k/forward/{op}' "
            f"(LogUniformCandidateSampler))") in report.summary()


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
@pytest.mark.parametrize("loss", ["nce", "softmax"])
def test_the_stateless_sampler_is_bitwise_with_canonical_single_steps(loss, mode):
    steps, runs = 4, 3
    with tf.Graph().as_default():  # canonical: one minimize per sess.run
        x, y = V1.placeholder(tf.int64, [BATCH]), V1.placeholder(tf.int64, [BATCH, 1])
        loss_fn, gs = word2vec(loss, stateless=True)
        value = loss_fn(x, y)
        train = V1.train.GradientDescentOptimizer(0.5).minimize(value, global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want_losses = [sess.run([train, value], {x: CONTEXT[k], y: LABELS[k]})[1]
                           for k in range(steps * runs)]
            want = {v.op.name: sess.run(v) for v in V1.global_variables()}
    with tf.Graph().as_default(), warnings.catch_warnings():
        warnings.simplefilter("error")  # stateless: no warning
        xs, ys = V1.placeholder(tf.int64, [steps, BATCH]), V1.placeholder(tf.int64, [steps, BATCH, 1])
        loss_fn, gs = word2vec(loss, stateless=True)
        unrolled = ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.5), steps,
                             inputs=(xs, ys), global_step=gs, mode=mode)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            losses = np.concatenate([unrolled.run(sess, {xs: CONTEXT[r * steps:(r + 1) * steps],
                                                         ys: LABELS[r * steps:(r + 1) * steps]})
                                     for r in range(runs)])
            got = {v.op.name: sess.run(v) for v in V1.global_variables()}
    assert losses.tobytes() == np.array(want_losses, np.float32).tobytes()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def test_log_uniform_candidates_follow_the_log_uniform_distribution():
    """Against numpy: the classes from the documented inverse CDF of the same uniform
    draws, the expected counts num_sampled * P(c); and against TensorFlow's own
    sampler's expected counts for the same classes (unique=False). Both compute P in
    float64 and round to float32 (TensorFlow as log((c+2)/(c+1)), here as a difference of
    logs), so they may differ by the float32 rounding of one value: 1 ulp, 2**-23 relative."""
    true = np.array([[0], [3], [49]], np.int64)
    seed = np.array([3, 11], np.int32)
    with tf.Graph().as_default():
        sampled, true_expected, sampled_expected = ms.sampling.log_uniform_candidates(
            tf.constant(true), 1000, VOCAB, seed=tf.constant(seed))
        u = tf.random.stateless_uniform([1000], seed=tf.constant(seed), dtype=tf.float64)
        _, tf_true_expected, _ = tf.random.log_uniform_candidate_sampler(
            tf.constant(true), 1, 1000, False, VOCAB, seed=1)
        with V1.Session() as sess:
            s, t, e, draws, tf_t = sess.run([sampled, true_expected, sampled_expected, u,
                                             tf_true_expected])
    log_range = np.log(VOCAB + 1)
    assert np.array_equal(s, np.floor(np.exp(draws * log_range) - 1).astype(np.int64) % VOCAB)
    p = lambda c: (np.log(c + 2.0) - np.log(c + 1.0)) / log_range  # noqa: E731
    assert np.array_equal(t, (p(true) * 1000).astype(np.float32))
    assert np.array_equal(e, (p(s) * 1000).astype(np.float32))
    assert np.allclose(t, tf_t, rtol=2.0 ** -23, atol=0)  # one float32 rounding apart (above)
    # The low classes are the frequent ones: class 0 about log(2)/log(51) of the draws.
    assert abs(np.mean(s == 0) - p(0)) < 4 * np.sqrt(p(0) * (1 - p(0)) / 1000)  # 4 sigma


def test_bad_sampler_arguments_are_refused_by_name():
    """Issue 28: range_max=0 was a raw FloorMod error at run time; 1-D labels were taken."""
    with tf.Graph().as_default():
        labels, seed = tf.constant([[1], [2]], tf.int64), tf.constant([1, 2])
        with pytest.raises(ValueError, match="range_max must be an int >= 1"):
            ms.sampling.log_uniform_candidates(labels, 4, 0, seed)
        with pytest.raises(ValueError, match="num_sampled must be an int >= 1"):
            ms.sampling.log_uniform_candidates(labels, 0, 10, seed)
        with pytest.raises(ValueError, match=r"true_classes must be \[batch, num_true\].*y\[:, None\]"):
            ms.sampling.log_uniform_candidates(tf.constant([1, 2], tf.int64), 4, 10, seed)
