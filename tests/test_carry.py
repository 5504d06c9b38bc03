"""State carried between steps (carry=): a PTB-style LSTM language model whose final
state of each step is the next step's initial state. The reference is the canonical
feed-dict script: one sess.run a step, its initial state a placeholder fed the final
state the previous run returned. Fused, the first step of each run is fed the state the
previous run carried out (Unrolled.carry)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
VOCAB, EMBED, HIDDEN, TIME, BATCH = 20, 6, 8, 4, 3
rng = np.random.RandomState(0)
WORDS = rng.randint(0, VOCAB, size=(12, BATCH, TIME + 1)).astype(np.int32)


def _var(name, shape, kind):
    init = np.random.RandomState(sum(map(ord, name))).uniform(-0.3, 0.3, shape).astype(np.float32)
    return V1.get_variable(name, initializer=init, use_resource=kind == "resource")


def language_model(kind):
    """loss_fn(words, (c, h)) -> (loss, (c, h) after the last time step): embeddings, an
    LSTM written out over TIME steps (its weights read at every time step), a softmax."""
    def loss_fn(words, state):
        emb, kernel = _var("embedding", [VOCAB, EMBED], kind), _var("lstm/kernel", [EMBED + HIDDEN, 4 * HIDDEN], kind)
        bias, out = _var("lstm/bias", [4 * HIDDEN], kind), _var("softmax/w", [HIDDEN, VOCAB], kind)
        c, h = state
        losses = []
        for t in range(TIME):
            x = tf.nn.embedding_lookup(emb, words[:, t])
            i, j, f, o = tf.split(tf.matmul(tf.concat([x, h], 1), kernel) + bias, 4, axis=1)
            c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(j)
            h = tf.sigmoid(o) * tf.tanh(c)
            losses.append(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=words[:, t + 1], logits=tf.matmul(h, out)))
        return tf.reduce_mean(tf.stack(losses)), (c, h)
    return loss_fn


def feed_dict_original(kind, steps):
    with tf.Graph().as_default():
        words = V1.placeholder(tf.int32, [BATCH, TIME + 1])
        state = (V1.placeholder(tf.float32, [BATCH, HIDDEN]), V1.placeholder(tf.float32, [BATCH, HIDDEN]))
        loss, final = language_model(kind)(words, state)
        train = V1.train.AdamOptimizer(0.02).minimize(loss)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            now = (np.zeros([BATCH, HIDDEN], np.float32),) * 2
            losses = []
            for k in range(steps):
                _, value, now = sess.run([train, loss, final], {words: WORDS[k], state[0]: now[0],
                                                               state[1]: now[1]})
                losses.append(value)
            return {v.op.name: sess.run(v) for v in V1.global_variables()}, np.array(losses), now


@pytest.mark.parametrize("kind, mode", [("resource", "unrolled"), ("resource", "while_loop"),
                                        ("ref", "unrolled")])
def test_carried_state_is_bitwise_with_the_feed_dict_original(kind, mode):
    steps, runs = 3, 4
    want, want_losses, want_state = feed_dict_original(kind, steps * runs)
    with tf.Graph().as_default():
        words = V1.placeholder(tf.int32, [steps, BATCH, TIME + 1])
        state = (V1.placeholder(tf.float32, [BATCH, HIDDEN]), V1.placeholder(tf.float32, [BATCH, HIDDEN]))
        unrolled = ms.unroll(language_model(kind), V1.train.AdamOptimizer(0.02), steps,
                             inputs=words, carry=state, mode=mode)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            now = (np.zeros([BATCH, HIDDEN], np.float32),) * 2
            losses = []
            for r in range(runs):
                _, value, now = sess.run(
                    [unrolled.train_op, unrolled.losses, unrolled.carry],
                    {words: WORDS[r * steps:(r + 1) * steps], state[0]: now[0], state[1]: now[1]})
                losses.extend(value)
            got = {v.op.name: sess.run(v) for v in V1.global_variables()}
    assert np.array(losses, np.float32).tobytes() == want_losses.astype(np.float32).tobytes()
    for a, b in zip(now, want_state):
        assert a.tobytes() == b.tobytes()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def test_a_carry_of_another_structure_is_refused():
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=1.0)
        with pytest.raises(ValueError, match="differs in structure"):
            ms.unroll(lambda c: (w * c[0], c[0]), V1.train.GradientDescentOptimizer(0.1), 2,
                      carry=(tf.constant(1.0), tf.constant(2.0)))
        with pytest.raises(TypeError, match=r"must return \(loss, next carry\)"):
            ms.unroll(lambda c: w * c, V1.train.GradientDescentOptimizer(0.1), 2,
                      carry=tf.constant(1.0), name="again")


def test_a_carry_with_none_or_another_dtype_is_refused_naming_the_carry():
    sgd = V1.train.GradientDescentOptimizer(0.1)
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=1.0)
        with pytest.raises(ValueError, match=r"carry= holds None \(item 1 flattened\)"):
            ms.unroll(lambda c: (w * c[0], c), sgd, 2, carry=(tf.constant(1.0), None))
        with pytest.raises(TypeError, match=r"carried out the carry's item 0 \(flattened\) as "
                                            r"int32 at inner step 1; carry= gave it as float32"):
            ms.unroll(lambda c: (w * c, tf.constant(1)), sgd, 2, carry=tf.constant(1.0), name="d")
        with pytest.raises(ValueError, match="carried out None as the carry's item 0"):
            ms.unroll(lambda c: (w * c, None), sgd, 2, carry=tf.constant(1.0), name="e")


def test_an_update_op_writing_state_a_gradient_still_reads_is_refused():
    """The state kept in a ref variable, overwritten through UPDATE_OPS (which run before
    the gradients): the gradient's read of it through the ref would see the new value.
    Refused naming both ops and carry=."""
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=np.ones([2, 2], np.float32), use_resource=False)
        state = V1.get_variable("state", initializer=np.ones([1, 2], np.float32),
                                use_resource=False, trainable=False)

        def loss_fn():
            h = tf.tanh(tf.matmul(state, w))
            V1.add_to_collection(V1.GraphKeys.UPDATE_OPS, V1.assign(state, h, name="keep_state"))
            return tf.reduce_sum(h)

        with pytest.raises(ValueError, match=r"the update op '.*keep_state' writes 'state' .*"
                                             r"gradient op '.*MatMul_grad.*' .*carry="):
            ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 2)


@pytest.mark.parametrize("transform", [lambda gv, step=None: gv, ms.scale(1.0)],
                         ids=["identity", "scale(1)"])
def test_a_transform_that_does_nothing_changes_nothing(transform):
    """The PTB-style model with GradientDescent (whose sparse apply scatter-adds repeated
    embedding rows one by one): a transform that does nothing used to run with the rows
    summed first (2.98e-8 off the embedding after 12 steps); against the feed-dict
    original without any transform, bitwise."""
    def original():
        with tf.Graph().as_default():
            words = V1.placeholder(tf.int32, [BATCH, TIME + 1])
            state = (V1.placeholder(tf.float32, [BATCH, HIDDEN]), V1.placeholder(tf.float32, [BATCH, HIDDEN]))
            loss, final = language_model("resource")(words, state)
            train = V1.train.GradientDescentOptimizer(0.5).minimize(loss)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                now = (np.zeros([BATCH, HIDDEN], np.float32),) * 2
                for k in range(12):
                    _, now = sess.run([train, final], {words: WORDS[k], state[0]: now[0], state[1]: now[1]})
                return {v.op.name: sess.run(v) for v in V1.global_variables()}

    want = original()
    with tf.Graph().as_default():
        words = V1.placeholder(tf.int32, [3, BATCH, TIME + 1])
        state = (V1.placeholder(tf.float32, [BATCH, HIDDEN]), V1.placeholder(tf.float32, [BATCH, HIDDEN]))
        unrolled = ms.unroll(language_model("resource"), V1.train.GradientDescentOptimizer(0.5), 3,
                             inputs=words, carry=state, grad_transforms=[transform])
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            now = (np.zeros([BATCH, HIDDEN], np.float32),) * 2
            for r in range(4):
                _, now = sess.run([unrolled.train_op, unrolled.carry],
                                  {words: WORDS[3 * r:3 * r + 3], state[0]: now[0], state[1]: now[1]})
            got = {v.op.name: sess.run(v) for v in V1.global_variables()}
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def test_verify_carries_the_state_from_run_to_run():
    """Issue 28: verify restarted every run (fused and single) from the build's feed, the
    zero state, so the single steps were not the program's own (a false DIVERGED, 0.0953
    at an LSTM bias). It now feeds each run what the run before carried out."""
    def build(steps):
        words = V1.placeholder(tf.int32, [steps, BATCH, TIME + 1])
        state = tuple(V1.placeholder(tf.float32, [BATCH, HIDDEN]) for _ in range(2))
        unrolled = ms.unroll(language_model("resource"), V1.train.AdamOptimizer(0.02), steps,
                             inputs=words, carry=state)
        zero = np.zeros([BATCH, HIDDEN], np.float32)
        return unrolled, lambda r: {words: WORDS[r * steps:(r + 1) * steps], state[0]: zero,
                                    state[1]: zero}

    report = ms.verify(build, steps=3, runs=4)
    assert report.ok and report.bitwise, report
    want, want_losses, _ = feed_dict_original("resource", 12)  # the program's own loop
    assert report.fused_losses.tobytes() == want_losses.astype(np.float32).tobytes()


SLOW_CARRY_UNDER_V1 = """
import warnings, importlib
import numpy as np, tensorflow as tf
tf.compat.v1.disable_v2_behavior()
import multistep as ms
importlib.import_module("multistep.builder.unroll").SLOW_BUILD_SECONDS = 0.0  # any build is slow
V1 = tf.compat.v1
w = V1.get_variable("w", initializer=1.0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ms.unroll(lambda c: (w * w * c, c * 0.5), V1.train.GradientDescentOptimizer(0.1), 3,
              carry=tf.constant(1.0))
print([str(c.message) for c in caught if "to build" in str(c.message)][0])
"""


def test_the_slow_build_warning_advises_loop_mode_for_a_carry_under_v1():
    """Issue 28: under v1 control flow the warning advised mode='while_loop' for a carry=
    build, which loop mode then refused. The single step's gradients are outside the
    loop now, and a carry in a v1 loop is bitwise (test_preambles): the advice holds."""
    result = subprocess.run([sys.executable, "-c", SLOW_CARRY_UNDER_V1], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mode='while_loop' builds the step once" in result.stdout
    assert "with the same results" in result.stdout
