"""The stale-forward check: the reused-logits trap and its relatives are refused at build time."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
X = np.random.RandomState(0).randn(6, 3).astype(np.float32)
Y = np.array([0, 1, 1, 0, 1, 0], np.int32)


def xent(logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=Y, logits=logits))


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_reused_logits_raise_naming_the_matmul(use_resource):
    with tf.Graph().as_default():
        w = V1.get_variable("w", [3, 2], use_resource=use_resource)
        logits = tf.matmul(X, w, name="reused_matmul")  # built once, outside the steps
        with pytest.raises(ms.StaleForwardError) as info:
            ms.unroll(lambda: xent(logits), V1.train.GradientDescentOptimizer(0.1), 3)
    message = str(info.value)
    assert "inner step 2 uses 'reused_matmul' (MatMul)" in message
    assert "'w'" in message and "inside loss_fn" in message
    assert isinstance(info.value, ValueError)


def test_keras_layer_called_outside_loss_fn_raises():
    with tf.Graph().as_default():
        logits = keras.layers.Dense(2, name="dense")(X)
        with pytest.raises(ms.StaleForwardError, match="dense/kernel"):
            ms.unroll(lambda: xent(logits), V1.train.AdamOptimizer(0.1), 2)


def test_partly_stale_loss_raises():
    # Only the second layer is stale: the first is rebuilt per step.
    with tf.Graph().as_default():
        w1 = V1.get_variable("w1", [3, 3])
        w2 = V1.get_variable("w2", [3, 2])
        stale_bias = tf.reduce_sum(w2, axis=0, name="stale_bias")
        with pytest.raises(ms.StaleForwardError, match="'stale_bias'.*'w2'"):
            ms.unroll(lambda: xent(tf.matmul(tf.matmul(X, w1), w2) + stale_bias),
                      V1.train.GradientDescentOptimizer(0.1), 2)


def test_stale_learning_rate_tensor_raises():
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        w = V1.get_variable("w", [3, 2])
        lr = V1.train.exponential_decay(0.1, gs, 10, 0.5)  # a tensor: evaluated once per run
        with pytest.raises(ms.StaleForwardError, match="global_step.*pass a callable"):
            ms.unroll(lambda: xent(tf.matmul(X, w)), V1.train.GradientDescentOptimizer(lr), 3,
                      global_step=gs)


def test_learning_rate_from_an_untrained_variable_is_fine():
    # A variable the fused op never writes cannot go stale inside a run.
    with tf.Graph().as_default():
        lr = tf.Variable(0.1, trainable=False, name="lr")
        w = V1.get_variable("w", [3, 2])
        ms.unroll(lambda: xent(tf.matmul(X, w)), V1.train.GradientDescentOptimizer(lr), 3)


def test_single_step_is_never_stale():
    with tf.Graph().as_default():
        w = V1.get_variable("w", [3, 2])
        logits = tf.matmul(X, w)
        ms.unroll(lambda: xent(logits), V1.train.GradientDescentOptimizer(0.1), 1)


@pytest.mark.parametrize("xla", [False, True])
def test_stateful_random_ops_warn(xla):
    # an unseeded dropout keeps its kernel's own stream (no seed to share one from)
    with tf.Graph().as_default():
        w = V1.get_variable("w", [3, 2], use_resource=True)
        with pytest.warns(RuntimeWarning, match="RandomUniform.*own stream \\(unseeded.*"
                                                "stateless") as caught:
            ms.unroll(lambda: xent(tf.nn.dropout(tf.matmul(X, w), rate=0.5)),
                      V1.train.GradientDescentOptimizer(0.1), 2, xla=xla)
    # The warning names the line that called ms.unroll, however deep the builder is (under
    # XLA it builds inside tf.function's tracing).
    assert {r.filename for r in caught if "own stream" in str(r.message)} == {__file__}


def test_random_initializers_do_not_warn():
    with tf.Graph().as_default():
        def loss_fn():
            w = V1.get_variable("w", [3, 2], initializer=V1.random_normal_initializer())
            return xent(tf.matmul(X, w))

        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 2)


def test_a_cond_ordered_only_through_its_data_inputs_waits_for_the_previous_step():
    """Lowered, a cond's reads wait for the cond's control inputs and the inputs each uses,
    not for all its inputs: a cond in step 2 whose order after step 1 came only through a
    data input would read 'w' at the start of the run. The compiler gives every cond of
    a copy the previous copy's end as a control input; the values are those of the
    program's own single steps (minimize, run three times)."""
    def build(fused):
        training = V1.placeholder_with_default(True, [])
        w = V1.get_variable("w", [4, 1], initializer=V1.constant_initializer(0.3))

        def loss_fn():
            h = tf.matmul(tf.ones([4, 4]), w)  # an input built in the step
            return tf.reduce_sum(tf.cond(training, lambda: h * tf.reduce_sum(w), lambda: h))

        opt = V1.train.GradientDescentOptimizer(0.01)
        return w, (ms.unroll(loss_fn, opt, 3).train_op if fused else opt.minimize(loss_fn()))

    values = {}
    for fused in (True, False):
        with tf.Graph().as_default() as graph, V1.Session() as sess:
            w, train = build(fused)
            sess.run(V1.global_variables_initializer())
            for _ in range(1 if fused else 3):
                sess.run(train)
            values[fused] = sess.run(w)
            if fused:
                conds = [op for op in graph.get_operations()
                         if op.type in ("If", "StatelessIf") and "/step_" in op.name]
                assert len(conds) == 6  # the forward cond and its gradient, each step
                for op in conds:
                    k = int(op.name.split("/step_")[1].split("/")[0])
                    if k > 1:
                        assert f"multistep/step_{k - 1}/end" in [c.name for c in op.control_inputs]
    assert values[True].tobytes() == values[False].tobytes()
