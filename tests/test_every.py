"""ms.every: a loop's Python every K steps, moved into the step (issue 37)."""

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms
from test_compile import _state as _globals  # (the program's variables, not multistep's)

V1 = tf.compat.v1
XS = np.random.RandomState(8).randn(13, 4, 3).astype(np.float32)


def _dqn(every_k=None):
    """A DQN's shape: the loss reads a target network, which the loop copies from the
    online network every 6 steps (the global step after the step a multiple of 6)."""
    x = V1.placeholder(tf.float32, [None, 3], "x")
    online = V1.get_variable("online", initializer=np.full([3, 2], 0.4, np.float32))
    target = V1.get_variable("target", initializer=np.full([3, 2], 0.1, np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, online) - tf.stop_gradient(tf.matmul(x, target)) - 1.0))
    step = V1.train.get_or_create_global_step()
    train = V1.train.AdamOptimizer(0.05).minimize(loss, global_step=step, var_list=[online])
    if every_k is None:
        return x, loss, train, step, target.assign(online).op
    return x, loss, train, step, ms.every(every_k, lambda: [target.assign(online)], after=train)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_a_target_copy_every_k_steps_in_the_graph_is_the_python_loops(mode):
    """The program as written copies with Python after each sess.run whose global step
    is a multiple of 6; compiled at N = 4 with ms.every (steps 6 and 12 fall inside runs),
    13 steps (a last run of 1 in loop mode): bitwise. A Python if between compiled calls
    would have copied at steps 8 and 12 only."""
    with tf.Graph().as_default():
        x, loss, train, step, copy = _dqn()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            losses, want = [], {}
            for k in range(13):
                losses.append(sess.run([loss, train], {x: XS[k]})[0])
                if sess.run(step) % 6 == 0:
                    sess.run(copy)
                want[k + 1] = _globals(sess)
            want_losses = np.array(losses, np.float32)
    with tf.Graph().as_default():
        x, loss, train, step, copied = _dqn(every_k=6)
        fused = ms.compile([loss, train, copied], steps=4, mode=mode)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            losses, fired = [], []
            runs = [4, 4, 4, 1] if mode == "while_loop" else [4, 4, 4]
            start = 0
            for n in runs:
                value, _, ran = fused.run(sess, feeds=[{x: XS[start + j]} for j in range(n)])
                losses.extend(value); fired.extend(ran); start += n
            got_losses, got = np.array(losses, np.float32), _globals(sess)
    count = len(got_losses)
    assert got_losses.tobytes() == want_losses[:count].tobytes()
    assert [i + 1 for i, f in enumerate(fired) if f] == [6, 12]
    for name in want[count]:  # after the last compiled step: weights, slots, target, step
        assert np.asarray(got[name]).tobytes() == np.asarray(want[count][name]).tobytes(), name


def test_every_refuses_bad_arguments_by_name():
    with tf.Graph().as_default():
        x, loss, train, step, _ = _dqn()
        with pytest.raises(ValueError, match="k must be an int >= 1"):
            ms.every(0, lambda: [], after=train)
        with pytest.raises(TypeError, match="fn must be a callable"):
            ms.every(2, [train], after=train)
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=1.0)
        train = V1.train.GradientDescentOptimizer(0.1).minimize(w * w)
        with pytest.raises(ValueError, match="no global step to count by"):
            ms.every(2, lambda: [], after=train)
