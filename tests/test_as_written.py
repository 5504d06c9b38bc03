"""Issue 37: programs in the shapes public TF1 training programs take, with their loops,
ported to ``ms.compile`` in at most 4 changed lines: bitwise with the program as written
(its own loop of single ``sess.run`` calls, run here in a graph of its own), or warned
or refused before a step is applied. Each port's changed lines are marked ``# port``."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms
from preamble_cases import visit_order
from test_compile import _bitwise as _same  # (every variable, bit for bit)
from test_compile import _state as _globals  # (the program's variables, not multistep's)
from multistep.compiler.tripwires import OriginalOpRanWarning

V1 = tf.compat.v1
N = 3
_rng = np.random.RandomState(37)
DATA_X = _rng.randn(40, 5).astype(np.float32)
DATA_Y = _rng.randint(0, 3, size=40).astype(np.int32)


def _mnist_style():
    """The MNIST-tutorial shape: placeholders of no shape for keep_prob and a bool
    training switch, a next_batch feed, Adam, a global step."""
    x = V1.placeholder(tf.float32, [None, 5], "x")
    y = V1.placeholder(tf.int32, [None], "y")
    keep_prob = V1.placeholder(tf.float32, name="keep_prob")  # no shape, fed a scalar
    training = V1.placeholder(tf.bool, name="training")  # no shape, fed a bool
    init = np.random.RandomState(1)  # the same initial values in every build
    w1 = V1.get_variable("w1", initializer=init.randn(5, 8).astype(np.float32) * 0.5)
    w2 = V1.get_variable("w2", initializer=init.randn(8, 3).astype(np.float32) * 0.5)
    h = tf.nn.relu(tf.matmul(x, w1))
    scale = tf.where(training, keep_prob, 1.0)  # a stateless stand-in for dropout's switch
    logits = tf.matmul(h * scale, w2)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    gs = V1.train.get_or_create_global_step()
    train = V1.train.AdamOptimizer(0.05).minimize(loss, global_step=gs)
    return x, y, keep_prob, training, loss, train


def _next_batch(state, size=4):
    """The tutorials' next_batch: consecutive slices, wrapping around."""
    start = state[0]
    state[0] = (start + size) % 40
    idx = np.arange(start, start + size) % 40
    return DATA_X[idx], DATA_Y[idx]


def test_a_feed_per_call_loop_ports_in_four_lines_and_is_bitwise():
    """keep_prob and a bool switch of no shape fed scalars, next_batch batches: the loop
    keeps feeding one batch a call; fused.run takes the run's N feed dicts. On main the
    scalar keep_prob crashed with "slice index 0 of dimension 0 out of bounds"."""
    def as_written():
        with tf.Graph().as_default():
            x, y, keep_prob, training, loss, train = _mnist_style()
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                state, losses = [0], []
                for step in range(12):
                    xb, yb = _next_batch(state)
                    value, _ = sess.run([loss, train], {x: xb, y: yb, keep_prob: 0.7, training: True})
                    losses.append(value)
                return np.array(losses, np.float32), _globals(sess)

    def ported():
        with tf.Graph().as_default():
            x, y, keep_prob, training, loss, train = _mnist_style()
            fused = ms.compile([loss, train], steps=N)  # port
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                state, losses, feeds = [0], [], []
                for step in range(12):
                    xb, yb = _next_batch(state)
                    feeds.append({x: xb, y: yb, keep_prob: 0.7, training: True})  # port
                    if len(feeds) == N:  # port
                        losses.extend(fused.run(sess, feeds=feeds)[0]); feeds = []  # port
                return np.array(losses, np.float32), _globals(sess)

    want_losses, want = as_written()
    got_losses, got = ported()
    assert got_losses.tobytes() == want_losses.tobytes()
    _same(got, want)


def test_a_replay_buffer_loop_with_a_final_short_run():
    """A DQN-style loop drawing batches with np.random.choice, 10 steps at N = 3: the
    last run takes one feed dict (loop mode runs len(feeds) steps). Bitwise."""
    def loop(compiled):
        with tf.Graph().as_default():
            x, y, keep_prob, training, loss, train = _mnist_style()
            fused = ms.compile([loss, train], steps=N) if compiled else None
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                draw, losses, feeds = np.random.RandomState(5), [], []
                for step in range(10):
                    idx = draw.choice(40, 4)
                    feed = {x: DATA_X[idx], y: DATA_Y[idx], keep_prob: 1.0, training: False}
                    if not compiled:
                        losses.append(sess.run([loss, train], feed)[0])
                        continue
                    feeds.append(feed)
                    if len(feeds) == N or step == 9:
                        losses.extend(fused.run(sess, feeds=feeds)[0]); feeds = []
                return np.array(losses, np.float32), _globals(sess)

    want_losses, want = loop(False)
    got_losses, got = loop(True)
    assert got_losses.tobytes() == want_losses.tobytes()
    _same(got, want)


def _ptb_style(batch=2, hidden=4):
    """The PTB language model's shape: the initial state is cell.zero_state's tensors,
    which the loop feeds with the previous run's final state."""
    x = V1.placeholder(tf.float32, [batch, 3, 2], "x")
    y = V1.placeholder(tf.float32, [batch, 3, hidden], "y")
    init = np.random.RandomState(2)  # the same initial values in every build
    w = V1.get_variable("w", initializer=init.randn(2 + hidden, hidden).astype(np.float32) * 0.5)
    initial = tf.zeros([batch, hidden], name="zero_state")
    state, outputs = initial, []
    for t in range(3):
        state = tf.tanh(tf.matmul(tf.concat([x[:, t], state], 1), w))
        outputs.append(state)
    final = tf.identity(state, name="final_state")
    loss = tf.reduce_mean(tf.square(tf.stack(outputs, 1) - y))
    train = V1.train.GradientDescentOptimizer(0.3).minimize(loss)
    return x, y, initial, final, loss, train


SEQ_X = _rng.randn(9, 2, 3, 2).astype(np.float32)
SEQ_Y = _rng.randn(9, 2, 3, 4).astype(np.float32) * 0.5


def test_fed_back_state_is_carried_step_to_step_and_run_to_run():
    """carry={initial: final}: the loop feeds each run the last run's final state, as
    the PTB model does each call. On main fused.run refused the zero_state feed with
    advice to make it a placeholder (wrong from step 2 if followed); now the refusal
    names carry=, and with it the port is bitwise."""
    with tf.Graph().as_default():
        x, y, initial, final, loss, train = _ptb_style()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            state, losses = sess.run(initial), []
            for k in range(9):
                value, state, _ = sess.run([loss, final, train], {x: SEQ_X[k], y: SEQ_Y[k], initial: state})
                losses.append(value)
            want_losses, want = np.array(losses, np.float32), _globals(sess)
    with tf.Graph().as_default():
        x, y, initial, final, loss, train = _ptb_style()
        without = ms.compile([loss, final, train], steps=N, name="without")
        fused = ms.compile([loss, final, train], steps=N, carry={initial: final})  # port
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            with pytest.raises(ValueError, match=r"zero_state:0.*computed inside the step.*carry="):
                without.run(sess, {x: SEQ_X[:3], y: SEQ_Y[:3], initial: np.zeros([2, 4])})
            state, losses = sess.run(initial), []
            for r in range(3):
                value, states, _ = fused.run(sess, {x: SEQ_X[3 * r:3 * r + 3], y: SEQ_Y[3 * r:3 * r + 3], initial: state})  # port
                state = states[-1]  # port
                losses.extend(value)
            got_losses, got = np.array(losses, np.float32), _globals(sess)
    assert got_losses.tobytes() == want_losses.tobytes()
    _same(got, want)

    def build(steps):
        x, y, initial, final, loss, train = _ptb_style()
        fused = ms.compile({"loss": loss, "train": train}, steps=steps, carry={initial: final})
        return fused, lambda r: {x: SEQ_X[3 * r:3 * r + 3], y: SEQ_Y[3 * r:3 * r + 3]}

    report = ms.verify(build, steps=N, runs=3)
    assert report.ok and report.bitwise and report.as_written, report.summary()


def _data_program(dropout):
    """A tf.data input (a one-shot iterator) and a dropout, as the CIFAR-10 tutorial's."""
    dataset = tf.data.Dataset.from_tensor_slices((DATA_X, DATA_Y)).batch(4).repeat()
    x, y = V1.data.make_one_shot_iterator(dataset).get_next()
    w = V1.get_variable("w", initializer=np.random.RandomState(3).randn(5, 3).astype(np.float32) * 0.5)
    h = tf.matmul(x, w)
    if dropout:
        h = tf.nn.dropout(h, rate=0.3, seed=3)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
    gs = V1.train.get_or_create_global_step()
    return loss, V1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=gs)


def test_tensorflows_own_hooks_fetching_the_original_loss_are_reported():
    """MonitoredTrainingSession with NanTensorHook and LoggingTensorHook on the original
    loss beside fused.train_op: the original forward pass runs too and takes a batch of
    its own from the iterator. Warned at the compiled program's next run (before its
    steps), naming the op. On main nothing said so (and TensorFlow's StopAtStepHook(12)
    trained 16 steps)."""
    with tf.Graph().as_default():
        loss, train = _data_program(dropout=False)
        fused = ms.compile({"loss": loss, "train": train}, steps=N)
        hooks = [V1.train.NanTensorHook(loss), V1.train.StopAtStepHook(last_step=6)]
        with V1.train.MonitoredSession(hooks=hooks) as sess:
            with pytest.warns(OriginalOpRanWarning, match=r"IteratorGetNext.*took a batch of "
                                                          r"its own.*ms.hooks"):
                sess.run(fused.train_op)
                sess.run(fused.train_op)


def test_the_port_with_compiled_values_handed_to_tensorflows_hooks_is_bitwise():
    """The documented port: TensorFlow's hooks take the compiled per-step values
    (NanTensorHook on their sum), ms.hooks.StopAtStepHook stands in for TensorFlow's
    (which counts one step a sess.run, and is refused before a step with the fix):
    bitwise with the program as written, and no original op runs (no warning)."""
    def run(compiled):
        with tf.Graph().as_default():
            loss, train = _data_program(dropout=False)
            fused = ms.compile({"loss": loss, "train": train}, steps=N) if compiled else None  # port
            watched = tf.reduce_sum(fused.losses) if compiled else loss  # port
            stop = ms.hooks.StopAtStepHook(fused, last_step=12) if compiled else V1.train.StopAtStepHook(last_step=12)  # port
            hooks = [V1.train.NanTensorHook(watched), stop]
            losses = []
            with V1.train.MonitoredSession(hooks=hooks) as sess:
                while not sess.should_stop():
                    values = fused.run(sess) if compiled else sess.run({"loss": loss, "train": train})  # port
                    losses.extend(np.reshape(values["loss"], -1))
            return np.array(losses, np.float32)

    want = run(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OriginalOpRanWarning)
        got = run(True)
    assert len(want) == 12 and got.tobytes() == want.tobytes()
    with tf.Graph().as_default():
        loss, train = _data_program(dropout=False)
        fused = ms.compile({"loss": loss, "train": train}, steps=N)
        with V1.train.MonitoredSession(hooks=[V1.train.StopAtStepHook(last_step=12)]) as sess:
            with pytest.raises(ValueError, match=r"TensorFlow's StopAtStepHook.*ms.hooks.StopAtStepHook"):
                fused.run(sess)


def test_an_evaluation_run_through_the_original_dropout_draws_the_programs_own_stream():
    """The VAE's end-of-epoch reconstruction runs the original forward pass, dropout
    included. The dropout's stream is shared (multistep.compiler.streams): the
    evaluation's draw and the compiled steps' draws follow one another as in the program
    as written, so weights and evaluations are bitwise those of single steps, and no
    OriginalOpRanWarning is raised. (Before the shared streams, this warned: the
    evaluation moved a stream the loop body's copy did not follow.)"""
    def program():
        x = V1.placeholder(tf.float32, [None, 5], "x")
        w = V1.get_variable("w", initializer=np.ones([5, 2], np.float32))
        h = tf.nn.dropout(tf.matmul(x, w), rate=0.5, seed=1)
        loss = tf.reduce_mean(tf.square(h))
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return x, w, h, loss, train

    with tf.Graph().as_default():  # as written: N single steps, an evaluation, N more
        x, w, h, loss, train = program()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = []
            for _ in range(2):
                for _ in range(N):
                    sess.run(train, {x: DATA_X[:4]})
                want += [sess.run(h, {x: DATA_X[:4]}), sess.run(w)]
    with tf.Graph().as_default():
        x, w, h, loss, train = program()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            fused = ms.compile([loss, train], steps=N)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                got = []
                for _ in range(2):
                    fused.run(sess, {x: DATA_X[:4]})
                    got += [sess.run(h, {x: DATA_X[:4]}), sess.run(w)]
    assert [a.tobytes() for a in got] == [b.tobytes() for b in want]


def test_a_second_compile_does_not_copy_the_first_ones_tripwires():
    """A program compiled twice (N steps, and steps=1 for a remainder): the second's
    steps do not run the first's tripwires, so its runs warn of nothing."""
    with tf.Graph().as_default():
        x, y, keep_prob, training, loss, train = _mnist_style()
        ms.compile([loss, train], steps=N)
        second = ms.compile([loss, train], steps=1, name="rest")
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            with warnings.catch_warnings():
                warnings.simplefilter("error", OriginalOpRanWarning)
                second.run(sess, {x: DATA_X[:4], y: DATA_Y[:4], keep_prob: 1.0, training: False})


def test_verify_of_a_queue_fed_program_runs_its_queue_runners():
    """A range_input_producer / batch queue input: verify starts the queue runners
    (and stops them) rather than waiting forever. On main it hung."""
    def build(steps):
        V1.set_random_seed(0)
        index = V1.train.range_input_producer(40, shuffle=False).dequeue()
        xb, yb = V1.train.batch([tf.gather(DATA_X, index), tf.gather(DATA_Y, index)], 4)
        w = V1.get_variable("w", initializer=np.ones([5, 3], np.float32) * 0.1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=yb, logits=tf.matmul(xb, w)))
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return ms.compile({"loss": loss, "train": train}, steps=steps), {}

    report = ms.verify(build, steps=N, runs=2)
    assert report.as_written and "not seen: what your loop does" in report.summary()
    assert report.ok and report.bitwise, report.summary()


def _queue_fed():
    """A range_input_producer / batch queue input (one thread: batches in order)."""
    index = V1.train.range_input_producer(40, shuffle=False).dequeue()
    xb, yb = V1.train.batch([tf.gather(DATA_X, index), tf.gather(DATA_Y, index)], 4,
                            num_threads=1)
    init = np.random.RandomState(2)
    w = V1.get_variable("w", initializer=init.randn(5, 3).astype(np.float32))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=yb, logits=tf.matmul(xb, w)))
    gs = V1.train.get_or_create_global_step()
    return loss, V1.train.AdamOptimizer(0.05).minimize(loss, global_step=gs)


def test_a_queue_fed_loop_with_queue_runners_ports_in_three_lines():
    """The TF1 queue pipeline's loop (a coordinator, start_queue_runners, one sess.run a
    step), ported: the compiled program dequeues the same batches in the same order and
    is bitwise with the program as written (9 steps). On main the port ran but
    ms.verify of it hung (no queue runner started)."""
    def program(port):
        with tf.Graph().as_default():
            loss, train = _queue_fed()
            if port:
                fused = ms.compile([loss, train], steps=N)  # port
            with V1.Session() as sess:
                sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
                coord = V1.train.Coordinator()
                threads = V1.train.start_queue_runners(sess, coord)
                losses = []
                for _ in range(0, 9, N if port else 1):  # port
                    if port:
                        losses.extend(fused.run(sess)[0])  # port
                    else:
                        losses.append(sess.run([loss, train])[0])
                coord.request_stop()
                coord.join(threads, stop_grace_period_secs=30)
                return np.array(losses, np.float32), _globals(sess)

    want, want_state = program(port=False)
    got, state = program(port=True)
    assert got.tobytes() == want.tobytes()
    _same(state, want_state)


def _conv_step(x, keep_prob):
    """The MNIST tutorial's convnet, small: conv + ReLU + 2x2 max pool twice, dropout
    on a scalar keep_prob, a dense layer, Adam."""
    init = np.random.RandomState(3)
    h = tf.reshape(x, [-1, 12, 12, 1])
    for i, channels in enumerate((4, 8)):
        w = V1.get_variable(f"conv{i}", initializer=init.randn(
            3, 3, h.shape[-1], channels).astype(np.float32) * 0.3)
        b = V1.get_variable(f"bias{i}", initializer=np.full([channels], 0.1, np.float32))
        h = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME") + b), 2, 2, "SAME")
    h = tf.nn.dropout(tf.reshape(h, [-1, 3 * 3 * 8]), rate=1 - keep_prob, seed=5)
    w = V1.get_variable("dense", initializer=init.randn(72, 3).astype(np.float32) * 0.3)
    labels = tf.cast(tf.reduce_sum(x, 1) > 0, tf.int32)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=tf.matmul(h, w)))
    return loss, V1.train.AdamOptimizer(0.01).minimize(loss)


def test_a_convnets_loop_body_runs_the_single_steps_kernels():
    """Loop mode runs oneDNN's kernels as the single step does (convolution, max pool
    and their gradients: the issue saw MaxPoolGrad in the loop body against
    _MklNativeMaxPoolGrad in the step), read from the partition graphs: the body's
    kernels, by name, are the single step's. Bitwise with 6 single steps (dropout
    included: the body's one kernel draws the program's stream).
    Which kernel the body's MaxPoolGrad got depended on the order oneDNN's layout pass
    visited the cyclic body in, hashed pointers: CI saw Eigen's in one process, and 3 of
    20 processes here did. Structural, whatever this process's order: the copy's gate
    puts each pool before its gradient (preamble_cases.visit_order)."""
    images = np.random.RandomState(4).randn(6, 8, 144).astype(np.float32)
    with tf.Graph().as_default():
        V1.set_random_seed(1)
        x, keep_prob = V1.placeholder(tf.float32, [None, 144], "x"), V1.placeholder(tf.float32)
        loss, train = _conv_step(x, keep_prob)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            feed = {x: images[0], keep_prob: 0.75}
            (want_first, _), nodes = ms.kernels.executed(sess, [loss, train], feed)
            single = ms.kernels.by_name(nodes)
            want = [want_first] + [sess.run([loss, train], {x: batch, keep_prob: 0.75})[0]
                                   for batch in images[1:]]
            want_state = _globals(sess)
    with tf.Graph().as_default():
        V1.set_random_seed(1)
        x, keep_prob = V1.placeholder(tf.float32, [None, 144], "x"), V1.placeholder(tf.float32)
        loss, train = _conv_step(x, keep_prob)
        fused = ms.compile([loss, train], steps=N)  # (the dropout's stream shared: no warning)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            feeds = [{x: batch, keep_prob: 0.75} for batch in images]
            (first, _), nodes = ms.kernels.executed(sess, fused.values,
                                                    fused.feed_dict(feeds=feeds[:N]))
            got = np.concatenate([first, fused.run(sess, feeds=feeds[N:])[0]])
            state = _globals(sess)
    assert "_MklNativeMaxPoolGrad" in {k.op for k in single.values()} or not any(
        k.op.startswith("_Mkl") for k in single.values())  # (oneDNN off: plain kernels)
    grads, unordered = visit_order(nodes, fused.name)
    assert len(grads) == 2 and unordered == [], (grads, unordered)
    body = ms.kernels.of_copies(nodes, fused.name)[ms.kernels.LOOP]
    # the dropout's draw: the original's RandomUniform as written, its shared stream's
    # stateless op (the same Philox draws) in the body; every other kernel the same
    drawn = {name: k.op for name, k in body.items() if "_stream/" in name}
    assert {"RngReadAndSkip", "StatelessRandomUniformV2"} <= set(drawn.values()), drawn
    assert not any(op.startswith("Random") for op in drawn.values()), drawn
    assert single.pop("dropout/random_uniform/RandomUniform").op == "RandomUniform"
    body = {name: k for name, k in body.items() if name not in drawn}
    assert body == single, set(body.items()) ^ set(single.items())
    assert got.tobytes() == np.array(want, np.float32).tobytes()
    _same(state, want_state)


def test_a_pool_inside_a_function_the_step_calls_comes_before_its_gradient_too():
    """The max pool in a tf.function the step calls: its gradient is in the gradient's
    function, inlined into the loop body before oneDNN's layout pass runs. The step is
    read into those functions, so the body has its gate (without it this reads
    unordered in every process). Bitwise with 3 single steps."""
    images = np.random.RandomState(4).randn(3, 8, 144).astype(np.float32)

    @tf.function
    def pool(h):
        return tf.nn.max_pool2d(h, 2, 2, "SAME")

    def program(x):
        init = np.random.RandomState(3)
        w = V1.get_variable("conv", initializer=init.randn(3, 3, 1, 4).astype(np.float32))
        h = pool(tf.nn.relu(tf.nn.conv2d(tf.reshape(x, [-1, 12, 12, 1]), w, 1, "SAME")))
        d = V1.get_variable("dense", initializer=init.randn(144, 3).astype(np.float32))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(tf.reduce_sum(x, 1) > 0, tf.int32),
            logits=tf.matmul(tf.reshape(h, [-1, 144]), d)))
        return loss, V1.train.AdamOptimizer(0.01).minimize(loss)

    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, [None, 144], "x")
        loss, train = program(x)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run([loss, train], {x: batch})[0] for batch in images]
            want_state = _globals(sess)
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, [None, 144], "x")
        fused = ms.compile(program(x), steps=3)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            (got, _), nodes = ms.kernels.executed(
                sess, fused.values, fused.feed_dict(feeds=[{x: batch} for batch in images]))
            state = _globals(sess)
    grads, unordered = visit_order(nodes, fused.name)
    assert len(grads) == 1 and unordered == [], (grads, unordered)
    assert got.tobytes() == np.array(want, np.float32).tobytes()
    _same(state, want_state)


def test_verify_finds_where_the_compiled_program_differs_from_the_program_as_written():
    """tf.add_n([x, tanh(x @ a), sin(x @ b), shared]) with x fed per step and `shared` a
    tensor from outside the step named to sort between the copies' names and the step's:
    under TensorFlow's default session config Grappler orders the AddN's inputs by name,
    so the copies sum in another order (2.4e-7 in the losses when measured; the build
    warns). verify against the program as written reports it; on main it compared
    ms.compile(N) with ms.compile(1), which sort alike, and said bitwise. Under
    ms.session_config() (that pass off) the two are bitwise. (The difference is one of
    summation order: on 6 steps of 8 random rows, some sum rounds apart on any CPU.)"""
    data = np.random.RandomState(6).randn(6, 8, 3).astype(np.float32)

    def build(steps):
        init = np.random.RandomState(7)
        x = V1.placeholder(tf.float32, [None, 3], "x")
        shared = V1.placeholder_with_default(np.full([8, 3], 0.37, np.float32), [8, 3],
                                             "b_shared")  # after "Sin", before "multistep"
        a = V1.get_variable("a", initializer=init.randn(3, 3).astype(np.float32))
        b = V1.get_variable("b", initializer=init.randn(3, 3).astype(np.float32))
        loss = tf.reduce_mean(tf.square(tf.add_n([x, tf.tanh(x @ a), tf.sin(x @ b), shared])))
        train = V1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return (ms.compile({"loss": loss, "train": train}, steps=steps, feeds=[x]),
                lambda r: {x: data[steps * r:steps * (r + 1)]})

    with pytest.warns(RuntimeWarning, match="the sum 'AddN'"):
        report = ms.verify(build, steps=N, runs=2)
        assert report.as_written and not report.bitwise, report.summary()
        assert ms.verify(build, steps=N, runs=2, config=ms.session_config()).bitwise
