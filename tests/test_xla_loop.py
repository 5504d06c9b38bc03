"""Issue 38: the XLA loop keeps every step's loss in buffers XLA:CPU's sequential executor
takes (at most 512 bytes: ``compile.CHUNK`` float32 steps a chunk), bitwise with the step
compiled alone (``steps=1, xla=True``) run once a step."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms
from multistep.compiler.compile import CHUNK

V1 = tf.compat.v1
X = np.random.RandomState(38).randn(50, 2).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


def _loss_fn(blow_up_at=None):
    """blobs' shape: 50 x 2 -> dense 2, softmax cross-entropy (every buffer of a step at
    most 400 bytes). ``blow_up_at``: the loss is infinite at that global step."""
    w = V1.get_variable("w", initializer=np.ones([2, 2], np.float32))
    b = V1.get_variable("b", initializer=np.zeros([2], np.float32))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=Y, logits=X @ w + b))
    if blow_up_at is not None:
        step = tf.cast(V1.train.get_or_create_global_step(), tf.float32)
        loss += tf.where(step < blow_up_at, 0.0, np.inf)
    return loss


def _xla_losses(steps, runs, lengths=None, blow_up_at=None):
    """Per-step losses and the variables after ``runs`` runs of ms.unroll(steps, loop,
    xla); ``lengths``: set_steps_per_run before each run."""
    with tf.Graph().as_default():
        unrolled = ms.unroll(lambda: _loss_fn(blow_up_at), V1.train.AdamOptimizer(0.01), steps,
                             mode="while_loop", xla=True,
                             global_step=V1.train.get_or_create_global_step())
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            losses = []
            for r in range(runs):
                if lengths:
                    unrolled.set_steps_per_run(sess, lengths[r])
                try:
                    losses.extend(unrolled.run(sess))
                except tf.errors.InvalidArgumentError:
                    break
            return np.array(losses, np.float32), {v.op.name: sess.run(v)
                                                  for v in V1.global_variables()}


@pytest.mark.parametrize("steps", [1, 127, 128, 129, 1000])
def test_every_steps_loss_is_the_single_step_xla_programs(steps):
    """One run of N steps against N runs of the step compiled alone: the losses (the
    chunked buffer, its chunk boundaries at 128) and every variable, bit for bit."""
    got, state = _xla_losses(steps, 1)
    want, want_state = _xla_losses(1, steps)
    assert got.shape == (steps,) and got.tobytes() == want.tobytes()
    assert sorted(state) == sorted(want_state)
    for name in want_state:
        assert np.array_equal(state[name], want_state[name]), name


def test_runs_shortened_and_cut_short_keep_the_single_step_programs_losses():
    """A 1000-step build run for 300, then 129 steps (set_steps_per_run: the last chunk
    partly written), then a run halted at global step 500 by an infinite loss
    (nonfinite="raise": its 71 steps before applied, nothing after; the run raises)."""
    got, state = _xla_losses(1000, 3, lengths=[300, 129, 200], blow_up_at=500)
    want, want_state = _xla_losses(1, 600, blow_up_at=500)
    assert len(got) == 429 and got.tobytes() == want[:429].tobytes()
    assert state["global_step"] == want_state["global_step"] == 500
    for name in want_state:
        assert np.array_equal(state[name], want_state[name]), name


_DUMPED = """
import numpy as np, tensorflow as tf
tf.compat.v1.disable_eager_execution()
import multistep as ms
V1 = tf.compat.v1
x = np.random.RandomState(0).randn(50, 2).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
def loss_fn():
    w = V1.get_variable("w", initializer=np.ones([2, 2], np.float32))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=x @ w))
with tf.Graph().as_default():
    unrolled = ms.unroll(loss_fn, V1.train.AdamOptimizer(0.01), 300, mode="while_loop", xla=True)
    with V1.Session() as sess:
        sess.run(V1.global_variables_initializer())
        unrolled.run(sess)
with tf.Graph().as_default():
    loss = loss_fn()
    fused = ms.compile([loss, V1.train.AdamOptimizer(0.01).minimize(loss)], 300, xla=True)
    with V1.Session() as sess:
        sess.run(V1.global_variables_initializer())
        fused.run(sess)
"""
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _innermost_loop_bodies(hlo):
    """{name: text} of each while loop body in an optimized HLO module that runs no loop
    itself (the body that runs every step)."""
    bodies = set(re.findall(r"\bwhile\(.*?body=%([\w.\-]+)", hlo))
    computations = dict(re.findall(r"^%([\w.\-]+) \(.*?\n(.*?)^}", hlo, re.M | re.S))
    return {name: computations[name] for name in bodies if " while(" not in computations[name]}


def test_the_xla_loops_step_body_touches_no_buffer_past_512_bytes(tmp_path):
    """XLA:CPU runs a thunk sequence (a loop body's) inline and in order only while every
    buffer it touches holds at most 512 bytes; one larger buffer (an f32[N] loss buffer,
    N > 128, written every step) sends every step through its concurrent executor. Read
    from the optimized HLO XLA dumps (--xla_dump_to) of ms.unroll's and ms.compile's
    loops at N = 300: every shape in the body that runs each step is within 512 bytes,
    and that body writes the losses into an f32[128] chunk. (Before, the one body held
    f32[300].) ms.unroll's (nonfinite="raise") tests the step's values and computes its
    halt state in one kernel: one instruction of the body is built from the step's check
    (before, 3 kernels: the gradient's is-finite reduction, the apply's bool and the
    value's index; a kernel more for each further gradient)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=f"--xla_dump_to={tmp_path}")
    result = subprocess.run([sys.executable, "-c", _DUMPED], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    modules = [p.read_text() for p in tmp_path.glob("*after_optimizations.txt")]
    bodies = {name: body for hlo in modules for name, body in _innermost_loop_bodies(hlo).items()}
    assert len(bodies) >= 2, sorted(bodies)  # ms.unroll's and ms.compile's
    checks = {name: re.findall(r"^ *(?:ROOT )?%\S+ = .*op_name=\"[^\"]*/check/", body, re.M)
              for name, body in bodies.items()}
    assert sorted(map(len, checks.values())) == [0, 1], checks  # ms.compile's: none
    for name, body in bodies.items():
        sizes = [_BYTES[kind] * int(np.prod([int(d) for d in dims.split(",") if d]))
                 for kind, dims in re.findall(r"\b(pred|bf16|[suf]\d+)\[([\d,]*)\]", body)]
        assert max(sizes) <= 512, (name, max(sizes))
        assert f"f32[{CHUNK}]" in body, name
        # nonfinite="raise" (ms.unroll's): the apply is kept or not by a select that XLA
        # fuses into it, not a conditional that copies the state in and out each step
        assert " conditional(" not in body, name


def test_a_runs_host_work_is_the_xla_call_and_a_handful_of_nodes():
    """Around the XLA program a run of loop mode (nonfinite="raise") runs only: the variables'
    handles, the run length's read (a table lookup: no cond on a variable being
    initialised, which cost 6 host nodes), the halt check (an
    Assert of the program's outputs and its message: no variable to reset or read, no string
    built; a loop's halt state is one int: the Assert's condition is its Equal to 0), the
    losses kept before it (one assign: a halted run's error holds the applied steps'
    losses, ``.values``) and the losses' slice (and its start) and name. The program's
    outputs have static
    shapes: a slice to the steps made inside it is an output of dynamic shape, which cost 17
    µs a call on blobs. A halt still names the step and the value, as unrolled mode does."""
    with tf.Graph().as_default() as graph:
        unrolled = ms.unroll(_loss_fn, V1.train.AdamOptimizer(0.01), 10, mode="while_loop",
                             xla=True, global_step=V1.train.get_or_create_global_step())
        [call] = [op for op in graph.get_operations() if op.type == "StatefulPartitionedCall"]
        assert all(t.shape.is_fully_defined() for t in call.outputs), call.outputs
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            unrolled.run(sess)
            metadata = V1.RunMetadata()
            sess.run(unrolled.losses, options=V1.RunOptions(trace_level=V1.RunOptions.FULL_TRACE),
                     run_metadata=metadata)
    ran = {n.node_name for d in metadata.step_stats.dev_stats for n in d.node_stats}
    types = {name: graph.get_operation_by_name(name).type for name in ran
             if name in {op.name for op in graph.get_operations()}}
    around = {name: kind for name, kind in types.items()
              if kind not in ("VarHandleOp", "StatefulPartitionedCall")
              and "/steps_per_run" not in name}
    assert sorted(around.values()) == ["Assert", "AssignVariableOp", "Const", "Const", "Const",
                                     "Equal", "Identity", "Slice"], around
    run_length = sorted(kind for name, kind in types.items() if "/steps_per_run" in name)
    assert run_length == ["Const", "Const", "LookupTableFindV2", "MutableHashTableV2"], run_length


def test_a_halted_loop_stops_after_the_step_that_halted_it():
    """nonfinite="raise" under XLA, loop mode: the step with a non-finite value runs its
    update ops (a single step runs them before its check raises) and applies nothing, and
    the loop stops there: the later steps' update ops do not move the moving statistic.
    Against canonical single steps (minimize under UPDATE_OPS): two steps, then the third
    batch's update op alone. (Before, the loop ran to its end: the moving mean took
    steps 4 and 5 too.)"""
    batches = np.arange(10, dtype=np.float32).reshape(5, 2)
    batches[2, 1] = np.inf  # step 3's loss and gradient are infinite

    def model(x):
        w = V1.get_variable("w", initializer=np.ones([2], np.float32))
        moving = V1.get_variable("moving", initializer=0.0, trainable=False)
        V1.add_to_collection(V1.GraphKeys.UPDATE_OPS,
                             moving.assign(0.5 * moving + 0.5 * tf.reduce_mean(x[:1])))
        return tf.reduce_sum(tf.square(w * x))

    def state(sess):
        return {v.op.name: sess.run(v) for v in V1.global_variables()}

    with tf.Graph().as_default():
        xs = V1.placeholder(tf.float32, [5, 2])
        unrolled = ms.unroll(model, V1.train.AdamOptimizer(0.1), 5, inputs=xs,
                             mode="while_loop", xla=True,
                             global_step=V1.train.get_or_create_global_step())
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="inner step 3 has a non-finite gradient for variable w"):
                unrolled.run(sess, {xs: batches})
            got = state(sess)
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, [2])
        loss = model(x)
        updates = V1.get_collection(V1.GraphKeys.UPDATE_OPS)
        with tf.control_dependencies(updates):
            train = V1.train.AdamOptimizer(0.1).minimize(
                loss, global_step=V1.train.get_or_create_global_step())
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for batch in batches[:2]:
                sess.run(train, {x: batch})
            sess.run(updates, {x: batches[2]})
            want = state(sess)
    assert sorted(got) == sorted(want)
    assert got["global_step"] == 2 and got["moving"] == want["moving"]
    for name in want:  # XLA against plain kernels: the weights within Adam's rounding
        # (two steps of ~20 float32 roundings each on values of order 1: 2 * 20 * 1.2e-7)
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=5e-6, err_msg=name)


def test_a_loops_per_step_values_keep_a_steps_static_shape():
    """The host takes the steps made out of the XLA program's whole arrays (a Slice of a
    size known at run time): each step's shape stays in the values' static shape, and a
    shortened run returns its steps' values."""
    with tf.Graph().as_default():
        w = V1.get_variable("w", initializer=np.ones([3, 2], np.float32))
        loss = tf.reduce_sum(w * w)
        grad = tf.gradients(loss, w)[0]
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        fused = ms.compile([loss, grad, train], 200, xla=True)
        assert fused.values[0].shape.as_list() == [None]
        assert fused.values[1].shape.as_list() == [None, 3, 2]
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            fused.set_steps_per_run(sess, 130)
            losses, grads, _ = fused.run(sess)
    assert losses.shape == (130,) and grads.shape == (130, 3, 2)
    assert grads[0].tolist() == [[2.0, 2.0]] * 3  # the first step's, from w = 1
