"""Layers that keep state: Keras 3 (in this process) and tf-keras's tf.compat.v1.layers
(in a subprocess: TF_USE_LEGACY_KERAS is read when TensorFlow is imported).

What Keras 3 does in tf.compat.v1 graph mode: BatchNormalization(training=True) and
Dropout build their state writes (the moving mean and variance; the seed generator's
state) as plain AssignVariableOps that nothing depends on and that are not in
UPDATE_OPS. A canonical single-step graph (`minimize` under UPDATE_OPS) never runs them:
the moving statistics stay at 0 and 1 and the dropout mask never changes. ms.unroll
refuses such a graph by default, naming the op; update_ops="all" runs every state write
of the forward pass in its step, ordered as built, as a tf.function single step (the
reference) runs them."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
rng = np.random.RandomState(5)
X = rng.randn(6, 8, 3).astype(np.float32)
Y = rng.randn(6, 8, 2).astype(np.float32)


def keras3_model():
    """A loss function over Keras 3 layers, and the list of state to compare."""
    bn = keras.layers.BatchNormalization(name="bn")
    drop = keras.layers.Dropout(0.5, seed=1, name="drop")
    dense = keras.layers.Dense(2, name="dense", kernel_initializer=keras.initializers.Constant(
        np.random.RandomState(1).randn(3, 2).astype(np.float32)))

    def loss_fn(x, y):
        return tf.reduce_mean(tf.square(dense(drop(bn(x, training=True), training=True)) - y))

    def state(optimizer, global_step):
        """Every variable, matched by its role, not its name: Keras numbers its seed
        generators per process (seed_generator, seed_generator_1, ...)."""
        out = {"global_step": global_step, "seed": drop.seed_generator.state.value}
        for layer in (bn, dense):
            for weight in layer.weights:
                var = weight.value
                out[weight.path] = var
                for slot in ("m", "v") if weight.trainable else ():
                    out[f"{weight.path}/{slot}"] = optimizer.get_slot(var, slot)
        return out
    return loss_fn, state


def reference(steps):
    """Single steps the TF2 way: one tf.function call per step (its automatic control
    dependencies run every state write of the forward pass, in program order), with the
    same Keras 3 layers and the same tf.compat.v1 optimizer."""
    loss_fn, state = keras3_model()
    optimizer = V1.train.AdamOptimizer(0.05)
    gs = tf.Variable(0, dtype=tf.int64, trainable=False)

    @tf.function(autograph=False)
    def step(x, y):
        optimizer.minimize(lambda: loss_fn(x, y), global_step=gs)

    for k in range(steps):
        step(tf.constant(X[k]), tf.constant(Y[k]))
    return {name: np.asarray(v) for name, v in state(optimizer, gs).items()}


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_keras3_batch_norm_and_dropout_with_update_ops_all(mode):
    want = reference(6)
    with tf.Graph().as_default():
        loss_fn, state = keras3_model()
        gs = V1.train.get_or_create_global_step()
        optimizer = V1.train.AdamOptimizer(0.05)
        xs, ys = V1.placeholder(tf.float32, [3, 8, 3]), V1.placeholder(tf.float32, [3, 8, 2])
        unrolled = ms.unroll(loss_fn, optimizer, 3, inputs=(xs, ys), global_step=gs,
                             update_ops="all", mode=mode)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for r in range(2):
                sess.run(unrolled.train_op, {xs: X[3 * r:3 * r + 3], ys: Y[3 * r:3 * r + 3]})
            got = sess.run(state(optimizer, gs))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].tobytes() == want[name].astype(got[name].dtype).tobytes(), name
    assert not np.array_equal(got["bn/moving_mean"], np.zeros(3, np.float32))  # they moved
    assert got["seed"].tolist() != [1, 0]                                       # the mask changed


def test_keras3_state_writes_are_refused_by_default():
    with tf.Graph().as_default(), pytest.raises(ValueError, match=r"AssignVariableOp.*update_ops='all'"):
        ms.unroll(keras3_model()[0], V1.train.AdamOptimizer(0.05), 3,
                  inputs=(tf.constant(X[:3]), tf.constant(Y[:3])))


LEGACY = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import tensorflow as tf
    import multistep as ms

    V1 = tf.compat.v1
    # oneDNN's convolution kernels split the bias gradient's sum over the intra-op threads,
    # in a split that depends on the graph around them: with 2 threads, the fused graph's
    # conv/bias differs from the single-step graph's in the last bits (with
    # TF_ENABLE_ONEDNN_OPTS=0, or one intra-op thread, the two are bitwise equal). One thread
    # in both sessions makes every sum run in one order, so the comparison can be bitwise.
    CONFIG = V1.ConfigProto(intra_op_parallelism_threads=1)
    rng = np.random.RandomState(2)
    X = rng.randn(6, 4, 5, 5, 1).astype(np.float32)
    Y = rng.randn(6, 4, 2).astype(np.float32)

    def model(x, y, step):
        h = V1.layers.conv2d(x, 3, 3, name="conv", kernel_initializer=V1.constant_initializer(0.1))
        h = V1.layers.batch_normalization(h, training=True, name="bn")
        h = tf.nn.relu(V1.layers.flatten(h))
        # tf.compat.v1.layers.dropout draws with a stateful op; made stateless, keyed on the step:
        h = tf.nn.experimental.stateless_dropout(h, 0.3, seed=tf.stack([7, tf.cast(step, tf.int32)]))
        out = V1.layers.dense(h, 2, name="dense", kernel_initializer=V1.constant_initializer(0.05))
        return tf.reduce_mean(tf.square(out - y))

    def unnamed(x, y, step):
        # Unnamed layers and default-named scopes: step 1 names them dense, dense_1, block;
        # every later step must ask for the same names (loss_fn is called once per step).
        h = V1.layers.dense(V1.layers.flatten(x), 4, kernel_initializer=V1.constant_initializer(0.1))
        with V1.variable_scope(None, default_name="block"):
            w = V1.get_variable("w", initializer=np.full((4, 2), 0.3, np.float32))
        out = V1.layers.dense(tf.matmul(tf.tanh(h), w), 2, kernel_initializer=V1.constant_initializer(0.2))
        return tf.reduce_mean(tf.square(out - y))

    def recurrent(cell_class):
        # dynamic_rnn gives its variable scope a caching_device: each variable's value is then
        # read once per sess.run and cached, so inside ms.unroll the cache is left out.
        def model(x, y, step):
            with V1.variable_scope("enc", reuse=V1.AUTO_REUSE,
                                   initializer=V1.random_uniform_initializer(-0.5, 0.5, seed=3)):
                cell = cell_class(3, name="cell")
                out, _ = V1.nn.dynamic_rnn(cell, tf.reshape(x, [4, 5, 5]), dtype=tf.float32)
            return tf.reduce_mean(tf.square(out[:, -1, :2] - y))
        return model

    def canonical(opt, steps):
        with tf.Graph().as_default():
            x, y = V1.placeholder(tf.float32, X.shape[1:]), V1.placeholder(tf.float32, Y.shape[1:])
            gs = V1.train.get_or_create_global_step()
            loss = MODEL(x, y, gs.read_value())
            with tf.control_dependencies(V1.get_collection(V1.GraphKeys.UPDATE_OPS)):
                train = opt().minimize(loss, global_step=gs)
            with V1.Session(config=CONFIG) as sess:
                sess.run(V1.global_variables_initializer())
                for k in range(steps):
                    sess.run(train, {x: X[k], y: Y[k]})
                return {v.op.name: sess.run(v) for v in V1.global_variables()}

    def fused(opt, steps, runs, mode):
        with tf.Graph().as_default():
            gs = V1.train.get_or_create_global_step()
            xs = V1.placeholder(tf.float32, (steps,) + X.shape[1:])
            ys = V1.placeholder(tf.float32, (steps,) + Y.shape[1:])
            u = ms.unroll(lambda x, y: MODEL(x, y, gs.read_value()), opt(), steps, inputs=(xs, ys),
                          global_step=gs, mode=mode)
            with V1.Session(config=CONFIG) as sess:
                sess.run(V1.global_variables_initializer())
                for r in range(runs):
                    sess.run(u.train_op, {xs: X[r * steps:(r + 1) * steps], ys: Y[r * steps:(r + 1) * steps]})
                return {v.op.name: sess.run(v) for v in V1.global_variables()}

    opts = {"GradientDescent": lambda: V1.train.GradientDescentOptimizer(0.1),
            "Adam": lambda: V1.train.AdamOptimizer(0.01)}
    results = {}
    for MODEL, name, opt in [(model, "GradientDescent", opts["GradientDescent"]),
                             (model, "Adam", opts["Adam"]), (unnamed, "unnamed", opts["Adam"]),
                             (recurrent(V1.nn.rnn_cell.LSTMCell), "lstm", opts["Adam"]),
                             (recurrent(V1.nn.rnn_cell.GRUCell), "gru", opts["GradientDescent"])]:
        want = canonical(opt, 6)
        for mode in ("unrolled", "while_loop"):
            got = fused(opt, 3, 2, mode)
            results[f"{name}-{mode}"] = {
                "names": sorted(got) == sorted(want),
                "differ": sorted(n for n in want if got.get(n, np.zeros(0)).tobytes() != want[n].tobytes()),
                "moving_mean_moved": bool(np.any(got.get("bn/moving_mean", 1) != 0)),
                "variables": sorted(want)}
    print(json.dumps(results))
""")


def run_legacy(tmp_path, source):
    """Runs ``source`` under TF_USE_LEGACY_KERAS=1 (read at import: a process of its own);
    returns the JSON of its last line."""
    script = tmp_path / "legacy.py"
    script.write_text(source)
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_tf1_layers_named_and_unnamed_under_tf_keras_match_canonical_single_steps(tmp_path):
    results = run_legacy(tmp_path, LEGACY)
    assert sorted(results) == ["Adam-unrolled", "Adam-while_loop", "GradientDescent-unrolled",
                               "GradientDescent-while_loop", "gru-unrolled", "gru-while_loop",
                               "lstm-unrolled", "lstm-while_loop", "unnamed-unrolled",
                               "unnamed-while_loop"]
    assert {"dense/kernel", "dense_1/kernel", "block/w"} <= set(results["unnamed-unrolled"]["variables"])
    for case, r in results.items():
        assert r["names"] and r["differ"] == [] and r["moving_mean_moved"], (case, r)


TF_KERAS_BN = textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import tf_keras
    import multistep as ms

    V1 = tf.compat.v1
    rng = np.random.RandomState(0)
    X, Y = rng.randn(6, 8, 3).astype(np.float32), rng.randn(6, 8, 2).astype(np.float32)

    def run(fused, mode="unrolled", update_ops="all"):
        with tf.Graph().as_default():
            training = V1.placeholder_with_default(True, [], name="training")
            bn = tf_keras.layers.BatchNormalization(name="bn")
            dense = tf_keras.layers.Dense(2, name="dense",
                                          kernel_initializer=tf_keras.initializers.Constant(0.3))
            loss_fn = lambda x, y: tf.reduce_mean(tf.square(dense(bn(x, training=training)) - y))
            if fused:
                xs, ys = V1.placeholder(tf.float32, [3, 8, 3]), V1.placeholder(tf.float32, [3, 8, 2])
                u = ms.unroll(loss_fn, V1.train.AdamOptimizer(0.05), 3, inputs=(xs, ys),
                              update_ops=update_ops, mode=mode)
                runs = [(u.train_op, {xs: X[r * 3:r * 3 + 3], ys: Y[r * 3:r * 3 + 3]}) for r in range(2)]
            else:  # the canonical tf-keras single step: the layer's updates before minimize
                x, y = V1.placeholder(tf.float32, [8, 3]), V1.placeholder(tf.float32, [8, 2])
                loss = loss_fn(x, y)
                with tf.control_dependencies(bn.updates):
                    train = V1.train.AdamOptimizer(0.05).minimize(loss)
                runs = [(train, {x: X[k], y: Y[k]}) for k in range(6)]
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                for op, feed in runs:
                    sess.run(op, feed)
                return {v.op.name: sess.run(v) for v in V1.global_variables()}

    want = run(False)
    out = {"moved": bool(np.any(want["bn/moving_mean"] != 0))}
    for mode in ("unrolled", "while_loop"):
        got = run(True, mode)
        out[mode] = sorted(n for n in want if got[n].tobytes() != want[n].tobytes())
    try:
        run(True, update_ops=True)
        out["refused"] = None
    except ValueError as error:
        out["refused"] = str(error)
    print(json.dumps(out))
""")


def test_tf_keras_batch_norm_on_a_training_placeholder_with_update_ops_all(tmp_path):
    """tf-keras BatchNormalization called with a `training` placeholder builds each moving
    statistic's update as a cond whose branch assigns, not in UPDATE_OPS: refused by
    default with the advice update_ops="all", which then runs the conds (it used to run
    only plain writes, and the refusal sent the user round in a circle); bitwise with
    the canonical tf-keras single step (its `layer.updates` before minimize)."""
    out = run_legacy(tmp_path, TF_KERAS_BN)
    assert out["moved"]
    assert out["unrolled"] == [] and out["while_loop"] == [], out
    assert "update_ops='all'" in out["refused"] and "conds holding the writes" in out["refused"]
