"""The shared-versus-copied rule against TensorFlow's own op registry."""

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

import multistep as ms
from multistep.compiler.placement import PLACEHOLDERS, STATE_OWNERS, STEP_RESOURCES

V1 = tf.compat.v1


def _makes_state(args):
    return any(a.type == types_pb2.DT_RESOURCE or a.is_ref for a in args)


def test_every_registered_op_that_makes_state_is_placed():
    """Every op TensorFlow registers that outputs a resource or a ref and takes none (it
    makes state rather than using it) is placed by the rule: shared or a step's own.
    ResourceConditionalAccumulator (what tf.compat.v1.ConditionalAccumulator builds in
    TensorFlow 2) was missing, and a user found it (issue 36, case 18)."""
    makers = []
    for name in dir(tf.raw_ops):
        op_def = op_def_registry.get(name)
        if op_def is not None and _makes_state(op_def.output_arg) and not _makes_state(
                op_def.input_arg):
            makers.append(name)
    assert len(makers) > 40, makers  # the walk saw the registry
    unplaced = [n for n in makers if n not in STATE_OWNERS | STEP_RESOURCES | PLACEHOLDERS]
    assert unplaced == [], unplaced


def test_case18_a_step_with_a_conditional_accumulator_is_bitwise_with_single_steps():
    """Issue 36, case 18: a step that averages its gradient through a
    ConditionalAccumulator (shared by the steps, as by single steps) compiles and matches
    the program's own single sess.run calls."""
    rng = np.random.RandomState(18)
    xs = rng.randn(6, 4, 3).astype(np.float32)

    def program():
        x = V1.placeholder(tf.float32, [None, 3], "x")
        w = V1.get_variable("w", initializer=np.full([3, 1], 0.3, np.float32))
        gs = V1.train.get_or_create_global_step()
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        acc = V1.ConditionalAccumulator(tf.float32, shape=[3, 1])
        applied = acc.apply_grad(tf.gradients(loss, w)[0], local_step=gs)
        with tf.control_dependencies([applied]):
            mean = acc.take_grad(1)
        train = tf.group(w.assign_sub(0.1 * mean), gs.assign_add(1))
        return x, {"loss": loss, "train": train}, acc.accumulator_ref.op.type

    with tf.Graph().as_default():
        x, fetches, kind = program()
        assert kind == "ResourceConditionalAccumulator"
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run(fetches, {x: xs[k]})["loss"] for k in range(6)]
            want_w = sess.run(V1.global_variables())
    with tf.Graph().as_default():
        x, fetches, _ = program()
        fused = ms.compile(fetches, steps=3)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            got = [fused.run(sess, {x: xs[3 * r:3 * r + 3]})["loss"] for r in range(2)]
            got_w = sess.run([v for v in V1.global_variables()
                              if not v.op.name.startswith("multistep/")])
    assert np.concatenate(got).tobytes() == np.array(want, np.float32).tobytes()
    for a, b in zip(got_w, want_w):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
