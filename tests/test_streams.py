"""multistep.compiler.streams: a random op's draws through its shared stream are, draw after
draw, the bits of the op's own kernel; ops no stateless op continues keep their kernel and
say why; a session that is not deferred computes what it computes without the rewrite."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms
from multistep.compiler import streams

v1 = tf.compat.v1
SEED, SEED2 = 11, 29
DRAWS = 8


def _ops(shape):
    """op type -> a function building that stateful op (seeded) in the default graph."""
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    seeds = dict(seed=SEED, seed2=SEED2)
    return {
        "RandomUniform": lambda: tf.raw_ops.RandomUniform(shape=shape, dtype=tf.float32, **seeds),
        "RandomStandardNormal": lambda: tf.raw_ops.RandomStandardNormal(
            shape=shape, dtype=tf.float64, **seeds),
        "TruncatedNormal": lambda: tf.raw_ops.TruncatedNormal(shape=shape, dtype=tf.float32,
                                                              **seeds),
        "RandomUniformInt": lambda: tf.raw_ops.RandomUniformInt(
            shape=shape, minval=tf.constant(-3, tf.int64), maxval=tf.constant(1 << 40, tf.int64),
            **seeds),
        "RandomShuffle": lambda: tf.raw_ops.RandomShuffle(value=value, **seeds),
        "RandomGamma": lambda: tf.raw_ops.RandomGamma(shape=shape, alpha=[0.5, 2.0], **seeds),
    }


def _draws(kind, shape, shared):
    """DRAWS draws of the op, each through a consumer (``tf.identity``), in one session;
    with ``shared``, the graph's streams shared first. Returns (draws, the op types of the
    kernels the last draw executed)."""
    graph = tf.Graph()
    with graph.as_default():
        drawn = tf.identity(_ops(shape)[kind](), name="consumer")
    if shared:
        assert not streams.share(graph).kept  # (every kind here is continued)
    with v1.Session(graph=graph) as sess:
        out = [sess.run(drawn) for _ in range(DRAWS - 1)]
        _, nodes = ms.kernels.executed(sess, drawn, None)
        out.append(_)
    return out, {k.op for k in ms.kernels.by_name(nodes).values()}


@pytest.mark.parametrize("shape", [(7,), (33, 5), (2,)])
@pytest.mark.parametrize("kind", sorted(streams.REPRODUCED))
def test_the_shared_stream_draws_the_kernels_bits_draw_after_draw(kind, shape):
    want, written = _draws(kind, shape, shared=False)
    got, executed = _draws(kind, shape, shared=True)
    assert kind in written and kind not in executed  # the original kernel never ran
    assert "RngReadAndSkip" in executed
    assert len({w.tobytes() for w in want}) > 1 or kind == "RandomShuffle" and shape[0] < 2
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


def test_a_shuffle_of_one_row_skips_nothing():
    # RandomShuffle of one row (or none) returns its input without moving its stream: a
    # second shuffle after it draws what it would have drawn first
    def program():
        one = tf.random.shuffle(tf.constant([[1.0, 2.0]]), seed=3)
        many = tf.random.shuffle(tf.range(9), seed=4)
        return one, many

    results = []
    for shared in (False, True):
        graph = tf.Graph()
        with graph.as_default():
            v1.set_random_seed(1)
            one, many = program()
        if shared:
            streams.share(graph)
        with v1.Session(graph=graph) as sess:
            results.append([sess.run([one, many])[1].tobytes() for _ in range(4)])
    assert results[0] == results[1]


@pytest.mark.parametrize("build, kind", [
    (lambda: tf.random.categorical(tf.zeros([2, 3]), 4, seed=1), "Multinomial"),
    (lambda: tf.random.poisson([3], [1.0, 2.0], seed=1), "RandomPoissonV2"),
    (lambda: tf.raw_ops.ParameterizedTruncatedNormal(
        shape=[3], means=0.0, stdevs=1.0, minvals=-1.0, maxvals=1.0, seed=1, seed2=2),
     "ParameterizedTruncatedNormal"),
])
def test_an_op_no_stateless_op_continues_keeps_its_kernel_and_says_why(build, kind):
    # their stateless twins (StatelessMultinomial, StatelessRandomPoisson,
    # StatelessParameterizedTruncatedNormal) take only a seed, which the kernel hashes
    # into Philox's key and counter (GenerateKey): no counter to continue from
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        out = tf.identity(build())
    kept = streams.share(graph).kept
    assert [why for name, why in kept.items() if graph.get_operation_by_name(name).type == kind] \
        == [streams._NOT_CONTINUED]  # noqa: SLF001
    assert out.op.inputs[0].op.type == kind  # its consumer still reads the kernel


def test_an_unseeded_op_keeps_its_kernel():
    graph = tf.Graph()
    with graph.as_default():
        drawn = tf.identity(tf.random.uniform([3]))  # no graph seed, no op seed
    assert "unseeded" in streams.share(graph).kept[drawn.op.inputs[0].op.name]


def test_an_op_a_session_has_run_keeps_its_kernel_and_later_ops_are_shared():
    # a rewire after a session ran the op's consumer would not reach that session: the op
    # keeps its kernel; an op built after that run is shared, in the same session
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(2)
        early = tf.identity(tf.random.uniform([3], seed=1))
    with v1.Session(graph=graph) as sess:
        first = sess.run(early)
        with graph.as_default():
            late = tf.identity(tf.random.normal([4], seed=2))
        kept = streams.share(graph).kept
        assert kept == {early.op.inputs[0].op.name:
                        "a session had run it before multistep saw the graph"}
        normal = graph.get_operation_by_name("random_normal/RandomStandardNormal")
        assert normal.outputs[0].consumers() == []  # rewired to its stream's draw
        got = [sess.run(late) for _ in range(3)] + [sess.run(early)]
    with tf.Graph().as_default() as plain:  # the same ops, never shared
        v1.set_random_seed(2)
        early = tf.identity(tf.random.uniform([3], seed=1))
        late = tf.identity(tf.random.normal([4], seed=2))
    with v1.Session(graph=plain) as sess:
        want_first = sess.run(early)
        want = [sess.run(late) for _ in range(3)] + [sess.run(early)]
    assert first.tobytes() == want_first.tobytes()
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want]


def test_a_session_that_is_not_deferred_draws_what_it_draws_without_the_rewrite():
    # One graph, shared by ms.deferred's session: a plain session of the same graph, made
    # after, in the same process, initialises its own counters and draws as written:
    # its stream starts where a fresh kernel's would, whatever the deferred one drew.
    def program():
        v1.set_random_seed(5)
        x = v1.placeholder(tf.float32, [None, 3])
        w = v1.get_variable("w", [3, 2], initializer=v1.glorot_uniform_initializer())
        h = tf.nn.dropout(x @ w, rate=0.5)
        loss = tf.reduce_mean(tf.square(h))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return x, loss, train, v1.global_variables_initializer()

    batch = np.ones([4, 3], np.float32)
    with tf.Graph().as_default() as plain:
        x, loss, train, init = program()
    with v1.Session(graph=plain) as sess:
        sess.run(init)
        want = [sess.run([loss, train], {x: batch})[0] for _ in range(5)]
    graph = tf.Graph()
    with graph.as_default():
        x, loss, train, init = program()
    deferred = ms.deferred(v1.Session(graph=graph), steps=4, fuse="at_once")
    deferred.run(init)
    lazy = [deferred.run([loss, train], {x: batch})[0] for _ in range(5)]
    with v1.Session(graph=graph) as sess:  # not deferred: its own stream, as written
        sess.run(init)
        again = [sess.run([loss, train], {x: batch})[0] for _ in range(5)]
    assert [float(v) for v in ms.value(lazy)] == [float(v) for v in want]
    assert deferred.report().runs == 2  # 4 + 1: the read of the fifth forced the last run
    deferred.close()
    assert [a.tobytes() for a in again] == [w.tobytes() for w in want]
    assert graph.get_operation_by_name("dropout/random_uniform/RandomUniform").outputs[
        0].consumers() == []  # rewired: the original kernel is never run


def test_the_counters_are_in_no_collection():
    # savers, initializers, global_variables() and report_uninitialized_variables are as
    # written: the counters are the session's, initialised by the session hook
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        v1.get_variable("w", [2], initializer=v1.random_uniform_initializer())
        before = {key: list(graph.get_collection(key)) for key in graph.get_all_collection_keys()}
    assert len(streams.share(graph).initializers) == 1
    after = {key: list(graph.get_collection(key)) for key in graph.get_all_collection_keys()}
    assert after == before
    with graph.as_default(), v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        assert sess.run(v1.report_uninitialized_variables()).size == 0


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_ms_compile_before_the_first_session_is_bitwise_in_both_modes(mode):
    # A dropout step compiled (3 steps a run) before any session, an evaluation through
    # the original dropout between runs, and a second program of the same step (one step,
    # for a remainder): every value and the weights bitwise those of single steps. On
    # the main before the shared streams, unrolled mode refused the step and loop mode
    # warned that the evaluation and the second program move other streams.
    def program():
        v1.set_random_seed(7)
        x = v1.placeholder(tf.float32, [None, 4], "x")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer())
        h = tf.nn.dropout(tf.nn.relu(x @ w), rate=0.4)
        loss = tf.reduce_mean(tf.square(h - 0.5))
        train = v1.train.AdamOptimizer(0.05).minimize(loss)
        return x, w, h, loss, train, v1.global_variables_initializer()

    batches = np.random.RandomState(2).randn(7, 5, 4).astype(np.float32)
    with tf.Graph().as_default():
        x, w, h, loss, train, init = program()
        with v1.Session() as sess:
            sess.run(init)
            want = [sess.run([loss, train], {x: b})[0] for b in batches[:3]]
            want.append(sess.run(h, {x: batches[0]}))
            want += [sess.run([loss, train], {x: b})[0] for b in batches[3:7]]
            want.append(sess.run(w))
    with tf.Graph().as_default():
        x, w, h, loss, train, init = program()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            fused = ms.compile([loss, train], steps=3, mode=mode)
            rest = ms.compile([loss, train], steps=1, mode=mode, name="rest")
            with v1.Session() as sess:
                sess.run(init)
                got = list(fused.run(sess, feeds=[{x: b} for b in batches[:3]])[0])
                got.append(sess.run(h, {x: batches[0]}))
                got += list(fused.run(sess, feeds=[{x: b} for b in batches[3:6]])[0])
                got += list(rest.run(sess, feeds=[{x: batches[6]}])[0])
                got.append(sess.run(w))
    assert [np.asarray(g).tobytes() for g in got] == [np.asarray(v).tobytes() for v in want]


def test_the_graph_keeps_the_users_names_and_adds_a_stream_scope_beside_each_op():
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        drawn = tf.nn.dropout(tf.ones([2, 3]), rate=0.5)
        before = [op.name for op in graph.get_operations()]
        with tf.name_scope("the_callers_scope"), tf.control_dependencies([drawn]):
            streams.share(graph)  # (as ms.compile does, inside its own name scope)
    after = [op.name for op in graph.get_operations()]
    assert after[:len(before)] == before  # the user's ops: all there, names unchanged
    added = after[len(before):]
    assert added and all(name.startswith("dropout/random_uniform/RandomUniform_stream/")
                         for name in added), added
    assert all(not graph.get_operation_by_name(name).control_inputs or
               all(c.name in added for c in graph.get_operation_by_name(name).control_inputs)
               for name in added)  # (none of the caller's control dependencies)
