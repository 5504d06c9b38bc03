"""Round 6 of "bitwise or refused" (the issue's numbered cases that are fixed so far): each
test is named for its case, and compares with the program as written (plain single
``sess.run`` calls) where the case is about bits."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms
from multistep.compiler.tripwires import OriginalOpRanWarning

v1 = tf.compat.v1


def _step(graph, *, extra_placeholder=False):
    with graph.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        valid = v1.placeholder(tf.float32, [None, 3], name="valid") if extra_placeholder else None
    return x, w, loss, train, valid


BATCHES = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3) / 20


def test_r6_03_a_feed_key_of_another_graph_is_refused():
    # main: accepted by name, and trained (Session.run refuses the same key)
    graph, other = tf.Graph(), tf.Graph()
    x, w, loss, train, _ = _step(graph)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=2)
    x_other = _step(other)[0]  # a placeholder of the same name, in a new graph
    with v1.Session(graph=graph) as sess:
        sess.run(v1.global_variables_initializer())
        with pytest.raises(ValueError, match="tensor of another graph"):
            fused.run(sess, {x_other: BATCHES[:2]})
        with pytest.raises(ValueError, match="tensor of another graph"):
            fused.run(sess, feeds=[{x_other: BATCHES[0]}, {x_other: BATCHES[1]}])
        np.testing.assert_array_equal(sess.run(w), np.ones([3, 1], np.float32))  # untouched


def test_r6_04_a_carry_that_does_nothing_is_refused_naming_the_key():
    # main: accepted and ignored (an initial the step never reads; a variable)
    graph = tf.Graph()
    x, w, loss, train, _ = _step(graph)
    with graph.as_default():
        unread = v1.placeholder(tf.float32, [None, 1], name="unread")
        h = tf.matmul(x, w)
        with pytest.raises(ValueError, match="carry's initial 'unread:0' is not read by the step"):
            ms.compile([loss, h, train], steps=2, carry={unread: h})
        state = v1.get_variable("state", [2, 1])
        with pytest.raises(TypeError, match="carry's initial 'state.*' is a variable"):
            ms.compile([loss, h, train], steps=2, carry={state: h})


def test_r6_07_a_fed_placeholder_the_step_does_not_read_is_ignored_as_session_run_does():
    # main: refused ("shared by the steps ... List it in ms.compile(feeds=...)")
    written, graph = tf.Graph(), tf.Graph()  # (the program as written: a graph of its own)
    px, pw, ploss, ptrain, pvalid = _step(written, extra_placeholder=True)
    x, w, loss, train, valid = _step(graph, extra_placeholder=True)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=4)
    with v1.Session(graph=written) as plain, v1.Session(graph=graph) as sess:
        plain.run(v1.variables_initializer([pw]))
        sess.run(v1.variables_initializer([w]))
        expected = [plain.run([ploss, ptrain], {px: BATCHES[k], pvalid: BATCHES[k] * 3})[0]
                    for k in range(4)]
        feeds = [{x: BATCHES[k], valid: BATCHES[k] * 3} for k in range(4)]  # differs each step
        losses, _ = fused.run(sess, feeds=feeds)
        assert losses.tobytes() == np.array(expected).tobytes()
        assert sess.run(w).tobytes() == plain.run(pw).tobytes()


def test_r6_08_a_carried_value_is_given_in_the_first_feed_dict_only():
    # main: refused ("feeds[1] feeds other placeholders than feeds[0]")
    def rnn_step():
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [2, 3], name="x")
            state = v1.placeholder(tf.float32, [2, 1], name="state")
            w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
            final = tf.tanh(tf.matmul(x, w) + state)
            loss = tf.reduce_mean(tf.square(final))
            train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return graph, x, state, final, loss, train, w

    written, px, pstate, pfinal, ploss, ptrain, pw = rnn_step()  # the program as written
    graph, x, state, final, loss, train, w = rnn_step()
    with graph.as_default():
        fused = ms.compile([loss, final, train], steps=4, carry={state: final})
    start = np.full([2, 1], 0.5, np.float32)
    with v1.Session(graph=written) as plain, v1.Session(graph=graph) as sess:
        plain.run(v1.variables_initializer([pw]))
        sess.run(v1.variables_initializer([w]))
        value, expected = start, []
        for k in range(4):  # the loop as written feeds the state back
            step_loss, value, _ = plain.run([ploss, pfinal, ptrain],
                                            {px: BATCHES[k], pstate: value})
            expected.append(step_loss)
        feeds = [{x: BATCHES[0], state: start}] + [{x: BATCHES[k]} for k in range(1, 4)]
        losses, finals, _ = fused.run(sess, feeds=feeds)
        assert losses.tobytes() == np.array(expected).tobytes()
        assert finals[-1].tobytes() == value.tobytes()
        with pytest.raises(ValueError, match=r"feeds\[1\] feeds the carried 'state:0'"):
            fused.run(sess, feeds=[{x: BATCHES[0]}, {x: BATCHES[1], state: start}])


def test_r6_20_a_refusal_says_how_many_more_ops_it_did_not_name():
    # main: named the first three random ops and not how many more there were
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3])
        w = v1.get_variable("w", [3, 1])
        h = tf.matmul(x, w)
        for k in range(5):  # (samplers: no stateless op continues their streams)
            h = h + tf.cast(tf.random.categorical(h, 1, seed=k), tf.float32)
        loss = tf.reduce_mean(h)
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(ValueError, match=r"Multinomial\) and 4 more random ops draw"):
            ms.compile([loss, train], steps=2, mode="unrolled")


def test_r6_19_bad_arguments_are_refused_naming_them(tmp_path):
    # main: raw or misleading errors for each (or, for StepSummaryHook, a folder ./None/)
    graph = tf.Graph()
    x, w, loss, train, _ = _step(graph)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=2)
        with pytest.raises(ValueError, match="name must be a non-empty name scope"):
            ms.compile([loss, train], steps=2, name="")
        with pytest.raises(ValueError, match="the fetch keyed 'loss'.*has shape"):
            ms.compile({"loss": tf.matmul(x, w), "train": train}, steps=2)
    with tf.Graph().as_default():
        v1.train.get_or_create_global_step()
        with pytest.raises(ValueError, match="ms.every: after.*another graph"):
            ms.every(2, lambda: [], after=train)
    with v1.Session(graph=graph) as sess:
        sess.run(v1.global_variables_initializer())
        for session in (None, "sess"):
            with pytest.raises(TypeError, match="run\\(session, ...\\) takes a"):
                fused.run(session)
        with pytest.raises(TypeError, match="feed_dict must be a dict.*feeds="):
            fused.run(sess, [{x: BATCHES[0]}])
        with pytest.raises(TypeError, match="feeds must be a list of feed dicts.*a dict"):
            fused.run(sess, feeds={x: BATCHES[:2]})
        with pytest.raises(TypeError, match="the value fed to 'x:0' is a"):
            fused.run(sess, {x: tf.constant(BATCHES[:2])})
        np.testing.assert_array_equal(sess.run(w), np.ones([3, 1], np.float32))  # untouched
    with pytest.raises(TypeError, match="build_fn must be a callable"):
        ms.verify(None, 3)
    with pytest.raises(TypeError, match="output_dir must be a directory path"):
        ms.hooks.StepSummaryHook(fused, None)


def test_r6_19_tf2_check_refuses_none_batches():
    # main: an AttributeError from inside the leading-dimension check
    model = tf.Variable(1.0)
    opt = tf.keras.optimizers.SGD(0.1)

    def step(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(batch * model)
        opt.apply_gradients([(tape.gradient(loss, model), model)])
        return loss

    with pytest.raises(TypeError, match="batches is None"):
        ms.tf2.check(ms.tf2.fuse(step, steps=2), None)


@pytest.mark.parametrize("use_resource", [True, False])
def test_r6_10_a_global_step_outside_the_collection_counts_the_steps(use_resource):
    # main: resource: TensorFlow's 'Existing "global_step" does not have integer type';
    # ref: AttributeError: 'SymbolicTensor' object has no attribute '_ref'
    def program():
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [None, 3], name="x")
            w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
            step = v1.Variable(0, name="global_step", trainable=False, use_resource=use_resource)
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
            train = v1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
        return graph, x, w, step, loss, train

    written, px, pw, pstep, ploss, ptrain = program()
    graph, x, w, step, loss, train = program()
    mode = "while_loop" if use_resource else "unrolled"  # (ref variables: unrolled here)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=4, mode=mode)
        assert fused.global_step is step and fused.step_increment == 1
    with v1.Session(graph=written) as plain, v1.Session(graph=graph) as sess:
        with written.as_default():
            plain.run(v1.global_variables_initializer())
        with graph.as_default():
            sess.run(v1.global_variables_initializer())
        expected = [plain.run([ploss, ptrain], {px: BATCHES[k]})[0] for k in range(4)]
        losses, _ = fused.run(sess, {x: BATCHES})
        assert losses.tobytes() == np.array(expected).tobytes()
        assert sess.run(w).tobytes() == plain.run(pw).tobytes()
        assert sess.run(step) == plain.run(pstep) == 4


@pytest.mark.parametrize("form", ["feed_dict", "feeds"])
def test_r6_12_a_failing_check_raises_step_failed_error_with_the_applied_steps(form):
    # main: TensorFlow's raw InvalidArgumentError (no count, no .values): its message
    # named only the node inside the loop body's function, "{{node step/CheckNumerics}}"
    def program():
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [None], name="x")
            w = v1.get_variable("w", [], initializer=v1.ones_initializer())
            # the check guards the apply (the gradient is the checked x)
            loss = tf.reduce_sum(tf.debugging.check_numerics(x, "x") * w)
            train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return graph, x, w, loss, train

    written, px, pw, ploss, ptrain = program()
    graph, x, w, loss, train = program()
    with graph.as_default():
        fused = ms.compile([loss, train], steps=3)
    batches = np.array([[1.0], [np.inf], [2.0]], np.float32)
    with v1.Session(graph=written) as plain, v1.Session(graph=graph) as sess:
        plain.run(v1.variables_initializer([pw]))
        sess.run(v1.variables_initializer([w]))
        first = plain.run([ploss, ptrain], {px: batches[0]})[0]
        with pytest.raises(tf.errors.InvalidArgumentError):
            plain.run(ptrain, {px: batches[1]})  # as written: the loop stops here
        kwargs = ({"feed_dict": {x: batches}} if form == "feed_dict"
                  else {"feeds": [{x: b} for b in batches]})
        with pytest.raises(ms.StepFailedError, match="the first 1 of its 3 steps") as info:
            fused.run(sess, **kwargs)
        assert info.value.values[0].tobytes() == np.array([first]).tobytes()
        assert sess.run(w).tobytes() == plain.run(pw).tobytes()


def _sparse_step(graph):
    """A step that fetches a SparseTensor whose entry count changes as it trains."""
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", initializer=np.array([[0.5], [-0.4], [0.3]], np.float32))
        h = tf.matmul(x, w)
        loss = tf.reduce_mean(tf.square(h - 1.0))
        sparse = tf.sparse.from_dense(tf.cast(h > 0.2, tf.float32) * h)
        train = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return x, w, loss, sparse, train


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_r6_17_a_sparse_tensor_fetch_comes_per_step_with_the_step_as_its_first_dimension(mode):
    # main: ValueError: Shape (None, 2) must have rank 1 (both modes), at build time
    written, graph = tf.Graph(), tf.Graph()
    x, w, loss, sparse, train = _sparse_step(written)
    want = []
    with v1.Session(graph=written) as sess:
        sess.run(v1.global_variables_initializer())
        for k in range(4):
            want.append(sess.run([sparse, train], {x: BATCHES[k]})[0])
    counts = [len(value.values) for value in want]
    assert len(set(counts)) > 1, counts  # (the case: entry counts that differ by step)
    x, w, loss, sparse, train = _sparse_step(graph)
    with graph.as_default():
        fused = ms.compile({"loss": loss, "sparse": sparse, "train": train}, steps=2, mode=mode)
    with v1.Session(graph=graph) as sess:
        sess.run(v1.global_variables_initializer())
        got = [fused.run(sess, {x: BATCHES[2 * r:2 * r + 2]})["sparse"] for r in range(2)]
    for r, value in enumerate(got):
        assert value.dense_shape.tolist() == [2, 2, 1]
        for k in range(2):
            one = want[2 * r + k]
            mine = value.indices[:, 0] == k
            assert value.indices[mine, 1:].tolist() == one.indices.tolist()
            assert value.values[mine].tobytes() == one.values.tobytes()
    with graph.as_default(), pytest.raises(ValueError, match="xla=True cannot fetch a tf.Sparse"):
        ms.compile({"loss": loss, "sparse": sparse, "train": train}, steps=2, xla=True)


def test_r6_18_a_sync_replicas_step_is_refused_naming_the_accumulator():
    # main: built; its first run waited for ever (no result within 300 s)
    graph = tf.Graph()
    with graph.as_default():
        x, w, loss, _, _ = _step(graph)
        sync = v1.train.SyncReplicasOptimizer(v1.train.GradientDescentOptimizer(0.1),
                                              replicas_to_aggregate=1, total_num_replicas=1)
        train = sync.minimize(loss, global_step=v1.train.get_or_create_global_step())
        with pytest.raises(ValueError, match=r"ConditionalAccumulator .*SyncReplicasOptimizer"
                                             r".*would wait on themselves"):
            ms.compile([loss, train], steps=2)


def test_r6_11_the_summary_hook_that_runs_the_original_forward_pass_is_named(tmp_path):
    # main: the warning named the op that ran (the iterator's), not the hook; and it
    # warned once per program, so a later, different effect went unsaid (case 5)
    import warnings

    graph = tf.Graph()
    with graph.as_default():
        data = tf.data.Dataset.from_tensor_slices(np.arange(60, dtype=np.float32).reshape(20, 3))
        x = v1.data.make_one_shot_iterator(data.batch(1)).get_next()
        w = v1.get_variable("w", [3, 1], initializer=v1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        v1.summary.scalar("loss", loss)
        train = v1.train.GradientDescentOptimizer(0.01).minimize(
            loss, global_step=v1.train.get_or_create_global_step())
        fused = ms.compile([loss, train], steps=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with v1.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path),
                                                       save_summaries_steps=1,
                                                       save_checkpoint_secs=None) as sess:
                    fused.run(sess)
                    sess.run(train)  # the original train op: another effect, said too
                    fused.run(sess)  # (said at the compiled program's next run)
            finally:
                v1.summary.FileWriterCache.clear()  # (the hook's writer and its thread)
    said = [str(w.message) for w in caught if issubclass(w.category, OriginalOpRanWarning)]
    batch = [m for m in said if "took a batch of its own" in m]
    assert len(batch) == 1 and "It is read by the summary 'loss'" in batch[0], said
    assert "SummarySaverHook" in batch[0] and "ms.hooks.monitored_training_session" in batch[0]
    assert "save_summaries_steps=None" in batch[0]
    assert any("applied an update of its own" in m for m in said), said


def test_r6_09_verify_takes_the_feed_forms_of_fused_run():
    # main: a build_fn feed could only be a dict (or run -> dict), and a placeholder of no
    # shape refused it, telling the user to pass feeds=, which verify did not take
    data = np.random.RandomState(0).randn(12, 2, 3).astype(np.float32)

    def build(steps):
        x = v1.placeholder(tf.float32, name="x")  # no shape, as MAML's
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        train = v1.train.AdamOptimizer(0.1).minimize(loss)
        fused = ms.compile({"loss": loss, "train": train}, steps)
        return fused, lambda run: [{x: data[(run * steps + k) % 12]} for k in range(steps)]

    report = ms.verify(build, steps=3, runs=3)
    assert report.ok and report.bitwise, report.summary()
    with tf.Graph().as_default():  # the single steps as written, by hand: the same losses
        x = v1.placeholder(tf.float32, name="x")
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        train = v1.train.AdamOptimizer(0.1).minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([loss, train], {x: data[k]})[0] for k in range(9)]
    assert np.array(report.single_losses, np.float32).tobytes() == \
        np.array(losses, np.float32).tobytes()


@pytest.mark.parametrize("where", ["v1 cond", "v2 cond", "tf.function"])
def test_r6_05_a_draw_inside_a_cond_or_a_tf_function_is_warned_once_a_session(where):
    # main: the tripwires skipped ops in a v1 cond and looked only at an op's own type
    # (a tf.function's call is not a random op's), and warned once a program: an
    # evaluation through the original dropout, in a fresh session too, moved the
    # streams unsaid
    import warnings

    if where == "v1 cond":
        v1.disable_control_flow_v2()  # (a training switch built as Switch and Merge)
    try:
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [None, 3], name="x")
            training = v1.placeholder_with_default(True, [], name="training")
            w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())

            @tf.function
            def dropout(t):
                return tf.nn.dropout(t, rate=0.5, seed=1)

            h = v1.cond(training, lambda: tf.nn.dropout(x, rate=0.5, seed=1),
                        lambda: x) if "cond" in where else dropout(x)
            loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - 1.0))
            train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # (loop mode's dropout note)
                fused = ms.compile([loss, train], steps=2)
    finally:
        v1.enable_control_flow_v2()
    data = np.ones([4, 3], np.float32)
    for _ in range(2):  # each session of the graph is warned
        with v1.Session(graph=graph) as sess:
            sess.run(w.initializer)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fused.run(sess, {x: data})
                if "cond" in where:
                    sess.run(loss, {x: data, training: False})  # the branch that does not draw
                    fused.run(sess, {x: data})
                quiet = list(caught)
                sess.run(loss, {x: data})  # the original dropout draws
                fused.run(sess, {x: data})
                fused.run(sess, {x: data})
            said = [str(c.message) for c in caught if c.category is OriginalOpRanWarning]
            assert not quiet, quiet
            if where == "v1 cond":  # (a v1 cond's op is rewired: one shared stream, nothing
                assert said == [], said  # to warn of; the functions' ops keep their own)
                continue
            assert len(said) == 1, said
            assert "RandomUniform" in said[0] and "random stream" in said[0], said
            assert "in a function" in said[0], said


def test_r6_21_the_users_own_step_runs_no_python_after_compile():
    # main: each guarded original op waited on a numpy_function, a Python callback per
    # op kind per run of the user's own step (2.5x slower on a CIFAR-sized step; the
    # figure: benchmarks/tripwire_cost.py). Now an in-graph insert: the single step's
    # executed kernels hold no PyFunc, and the compiled program calls Python only in a
    # run that warns
    graph = tf.Graph()
    x, _, loss, train, _ = _step(graph)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=2)
    options = v1.RunOptions(output_partition_graphs=True)
    data = {x: np.ones([2, 3], np.float32)}

    def kernels(fetch, feed):
        metadata = v1.RunMetadata()
        sess.run(fetch, feed, options=options, run_metadata=metadata)
        return {n.op for g in metadata.partition_graphs for n in g.node}

    with v1.Session(graph=graph) as sess:
        sess.run(v1.global_variables_initializer())
        compiled = kernels(fused.train_op, {fused.inputs[x]: np.ones([2, 2, 3], np.float32)})
        single = kernels(train, data)
        assert "LookupTableInsertV2" in single  # (the tripwire is there...)
        assert not {"PyFunc", "EagerPyFunc"} & single, single  # (... and is no callback)
        assert "PyFunc" in compiled  # (in the check's branch, not taken in this run)
        with pytest.warns(OriginalOpRanWarning, match="applied an update of its own"):
            fused.run(sess, data)  # the single step above ran: said now, before the steps


def test_r6_13_step_failed_error_counts_the_failing_steps_own_update():
    # main: "the first 1 of its 3 steps were applied", where the failing step's own
    # update had run too (its check reads the apply's result, as a check after the train
    # op does): the global step had moved by 2
    def program():
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [], name="x")
            w = v1.get_variable("w", [], initializer=v1.ones_initializer())
            step = v1.train.get_or_create_global_step()
            loss = tf.square(w - x)
            train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
            with tf.control_dependencies([train]):  # checked after the update
                checked = tf.debugging.check_numerics(w * x, "w * x")
        return graph, x, w, step, checked, train

    written, px, pw, pstep, pchecked, ptrain = program()
    graph, x, w, step, checked, train = program()
    with graph.as_default():
        fused = ms.compile([checked, train], steps=3)
    batches = np.array([1.0, np.inf, 2.0], np.float32)
    with v1.Session(graph=written) as plain, v1.Session(graph=graph) as sess:
        plain.run(v1.variables_initializer([pw, pstep]))
        sess.run(v1.variables_initializer([w, step]))
        plain.run([pchecked, ptrain], {px: batches[0]})
        with pytest.raises(tf.errors.InvalidArgumentError):
            plain.run([pchecked, ptrain], {px: batches[1]})  # as written: the loop stops here
        with pytest.raises(ms.StepFailedError, match=r"the first 1 of its 3 steps were "
                           r"applied.*step 2's own updates ran.*moved by 2 in this run, to 2"):
            fused.run(sess, {x: batches})
        assert sess.run(step) == plain.run(pstep) == 2
        assert sess.run(w).tobytes() == plain.run(pw).tobytes()


def test_r6_14_a_halted_xla_run_holds_the_applied_steps_losses():
    # main: under XLA, nonfinite="raise" raised TensorFlow's InvalidArgumentError with no
    # .values: the losses of the steps the run applied were lost
    def run(data):
        with tf.Graph().as_default():
            def loss_fn(x):
                w = v1.get_variable("w", [], initializer=v1.ones_initializer())
                return tf.reduce_sum(tf.square(w * x))

            fused = ms.unroll(loss_fn, v1.train.GradientDescentOptimizer(0.01), 4,
                              inputs=[data], mode="while_loop", xla=True, nonfinite="raise")
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                try:
                    return fused.run(sess), sess.run(fused.var_list[0])
                except ms.StepFailedError as error:
                    return error, sess.run(fused.var_list[0])

    finite, _ = run(np.array([[1.0], [2.0], [5.0], [3.0]], np.float32))
    error, _ = run(np.array([[1.0], [2.0], [np.inf], [3.0]], np.float32))
    assert isinstance(error, tf.errors.InvalidArgumentError)  # (what it raised before)
    assert "inner step 3 has a non-finite" in str(error)
    assert error.values.tobytes() == finite[:2].tobytes()  # the same program's two steps


def test_r6_16_verify_of_a_step_reading_a_queue_the_loop_fills_is_refused_at_once():
    # main: verify waited for ever on the first dequeue (the program fills its FIFOQueue
    # with enqueue_many from its own loop; verify's session starts with it empty)
    def build(steps):
        queue = tf.queue.FIFOQueue(64, [tf.float32], shapes=[[3]])
        x = queue.dequeue_many(2)
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return ms.compile({"loss": loss, "train": train}, steps), None

    with pytest.raises(ValueError, match=r"dequeues from 'fifo_queue', which no queue runner "
                                         r"fills.*wait for ever.*add_queue_runner"):
        ms.verify(build, 2)


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_r6_01_every_before_the_step_copies_as_the_loop_above_the_train_run_does(mode):
    # main: ms.every had only after=: the DQN's copy above its train run, ported as
    # after=, never copied at step 0 and copied after the last step, unsaid
    def program(port):
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [4], name="x")
            w = v1.get_variable("w", initializer=np.float32(0.5))
            target = v1.get_variable("target", initializer=np.float32(0.0))
            step = v1.train.get_or_create_global_step()
            loss = tf.reduce_mean(tf.square(w * x - target - 1.0))  # reads the target
            train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
            copy = ms.every(3, lambda: [target.assign(w)], before=train) if port else \
                target.assign(w)
        return graph, x, w, target, step, loss, train, copy

    batches = np.random.RandomState(1).randn(6, 4).astype(np.float32)
    graph, x, w, target, step, loss, train, copy = program(port=False)
    with v1.Session(graph=graph) as sess:  # as written: the copy above the train run
        sess.run(v1.global_variables_initializer())
        losses = []
        for b in batches:
            if sess.run(step) % 3 == 0:
                sess.run(copy)
            losses.append(sess.run([loss, train], {x: b})[0])
        want = sess.run([w, target, step]) + [np.array(losses)]
    graph, x, w, target, step, loss, train, _ = program(port=True)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=3, mode=mode)
    with v1.Session(graph=graph) as sess:
        sess.run(v1.global_variables_initializer())
        losses = [fused.run(sess, {x: batches[3 * r:3 * r + 3]})[0] for r in range(2)]
        got = sess.run([w, target, step]) + [np.concatenate(losses)]
    for a, b in zip(got, want):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (got, want)


def test_r6_01_verify_says_every_ops_are_compared_with_themselves():
    # main: verify said OK of the after= port that never copied at step 0: its reference
    # ran the ms.every op too, and the report did not say so
    def build(steps):
        w = v1.get_variable("w", initializer=np.float32(0.5))
        target = v1.get_variable("target", initializer=np.float32(0.0))
        step = v1.train.get_or_create_global_step()
        loss = tf.square(w - target - 1.0)
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
        copied = ms.every(3, lambda: [target.assign(w)], after=train)
        return ms.compile({"loss": loss, "train": train, "copied": copied}, steps), None

    report = ms.verify(build, 3, runs=2)
    assert report.ok and len(report.every) == 1 and report.every[0].startswith("every/")
    assert "ms.every ops in the step" in report.summary() and "above it" in report.summary()


def test_r6_19_tensorflows_nan_hook_on_the_original_loss_is_refused_naming_the_fix():
    # main: TensorFlow's "You must feed a value for placeholder 'x'", raised from the
    # hook's fetch, with no pointer to fused.losses
    graph = tf.Graph()
    x, _, loss, train, _ = _step(graph)
    with graph.as_default():
        fused = ms.compile([loss, train], steps=2)
        for hook in (v1.train.NanTensorHook(loss),
                     v1.train.LoggingTensorHook({"loss": loss.name}, every_n_iter=1)):
            with v1.train.MonitoredSession(hooks=[hook]) as sess:
                with pytest.raises(ValueError, match=rf"{type(hook).__name__}.*placeholder"
                                                     rf"\(s\) 'x'.*NanTensorHook\(tf\.reduce_sum"
                                                     rf"\(fused\.losses\)\)"):
                    fused.run(sess, {x: BATCHES[:2]})
        fix = v1.train.NanTensorHook(tf.reduce_sum(fused.losses))
        with v1.train.MonitoredSession(hooks=[fix]) as sess:
            assert fused.run(sess, {x: BATCHES[:2]})[0].shape == (2,)  # the fix works


def test_r6_15_a_run_cut_short_by_its_input_writes_its_applied_steps_summaries(tmp_path):
    # main: under MonitoredTrainingSession, StepSummaryHook wrote nothing of the steps a
    # run applied before its input ran out (the hook's after_run never came), unsaid
    import glob
    import os

    data = np.random.RandomState(2).randn(5, 3).astype(np.float32)

    def program():
        x = v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(data).batch(1)).get_next()
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=v1.train.get_or_create_global_step())
        return loss, train

    with tf.Graph().as_default():  # as written: a sess.run a step, to the end of the data
        loss, train = program()
        want = []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(5):
                want.append(sess.run([loss, train])[0])
    with tf.Graph().as_default():
        loss, train = program()
        fused = ms.compile({"loss": loss, "train": train}, steps=2)
        hooks = [ms.hooks.StepSummaryHook(fused, str(tmp_path))]
        try:
            with v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
                while not sess.should_stop():
                    fused.run(sess)  # 2 + 2 steps, then 1 of 2 before the data runs out
        finally:
            v1.summary.FileWriterCache.clear()
    got = [(event.step, value.simple_value)
           for path in sorted(glob.glob(os.path.join(tmp_path, "events.out.tfevents.*")))
           for event in v1.train.summary_iterator(path) for value in event.summary.value
           if value.tag == "loss"]
    assert [step for step, _ in got] == [1, 2, 3, 4, 5], got
    assert np.array([v for _, v in got], np.float32).tobytes() == \
        np.array(want, np.float32).tobytes()


def _ema_step(graph, use_resource, ordered):
    """A step with an EMA of its weight, decay by the global step (num_updates=): after
    the apply (``ordered``, the CIFAR-10 tutorial's form now), or grouped beside it (its
    pre-2017 form: the EMA's reads and the apply's writes of the same variables unordered)."""
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer(),
                            use_resource=use_resource)
        step = v1.get_variable("global_step", [], tf.int64, v1.zeros_initializer(),
                               trainable=False, use_resource=use_resource)
        v1.add_to_collection(v1.GraphKeys.GLOBAL_STEP, step)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
        ema = v1.train.ExponentialMovingAverage(0.9, num_updates=step)
        if ordered:
            with tf.control_dependencies([train]):
                op = ema.apply([w])
        else:
            op = tf.group(train, ema.apply([w]))
    return x, [w, ema.average(w), step], loss, op


@pytest.mark.parametrize("use_resource,mode", [(False, "unrolled"), (True, "while_loop")])
def test_r6_02_an_ema_unordered_against_the_apply_is_refused_and_its_fix_is_bitwise(
        use_resource, mode):
    # main: compiled without a word; verify said DIVERGED (or OK, run by run) naming nothing
    graph = tf.Graph()
    x, state, loss, op = _ema_step(graph, use_resource, ordered=False)
    with graph.as_default(), pytest.raises(
            ValueError, match=r"reads 'global_step' in 'ExponentialMovingAverage/num_updates"
                              r".*no order against the step's write of it.*AssignMovingAvg"):
        ms.compile([loss, op], steps=3, mode=mode)
    written, graph = tf.Graph(), tf.Graph()  # the fix the message gives: the EMA after
    px, pstate, ploss, pop = _ema_step(written, use_resource, ordered=True)
    x, state, loss, op = _ema_step(graph, use_resource, ordered=True)
    with graph.as_default():
        fused = ms.compile([loss, op], steps=3, mode=mode)
    data = np.random.RandomState(2).randn(6, 4, 3).astype(np.float32)
    with v1.Session(graph=written) as plain, v1.Session(graph=graph) as sess:
        for session, g in ((plain, written), (sess, graph)):
            for variable in g.get_collection("variables"):  # in order: the shadow's
                session.run(variable.initializer)  # initializer reads the weight's value
        expected = [plain.run([ploss, pop], {px: data[k]})[0] for k in range(6)]
        losses = np.concatenate([fused.run(sess, {x: data[3 * r:3 * r + 3]})[0]
                                 for r in range(2)])
        assert losses.tobytes() == np.array(expected).tobytes()
        for got, want in zip(sess.run(state), plain.run(pstate)):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
        assert sess.run(state[2]) == 6


def test_r6_06_verify_refuses_the_racy_ema_and_names_draws_an_evaluation_would_move():
    # main: verify said DIVERGED of the tutorial's pre-2017 EMA (or OK, run by run: the
    # single steps themselves race), and OK of a step that draws with no word that an
    # evaluation through the original random op moves the compiled steps' stream
    def racy(steps):
        x, _, loss, op = _ema_step(v1.get_default_graph(), True, ordered=False)
        return ms.compile([loss, op], steps), {x: np.ones([4, 3], np.float32)}

    with pytest.raises(ValueError, match="no order against the step's write"):
        ms.verify(racy, steps=2, runs=1)

    def drawing(steps):
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3, 1], initializer=v1.ones_initializer())
        hidden = tf.nn.dropout(tf.matmul(x, w), rate=0.5)
        loss = tf.reduce_mean(tf.square(hidden - 1.0))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return ms.compile([loss, train], steps), {x: np.ones([4, 3], np.float32)}

    with warnings.catch_warnings():  # the dropout's stream is shared: nothing to warn of
        warnings.simplefilter("error", RuntimeWarning)
        report = ms.verify(drawing, steps=2, runs=2)
    assert report.ok and report.bitwise, report.summary()
    assert "random draws" not in report.summary()  # (an evaluation no longer moves it)


def test_r6_23_the_original_op_and_the_loops_copy_draw_one_stream():
    # The research answer of this case (a draw is a function of the op's seeds and of how
    # far its counter moved) is now built: ms.compile before the first session shares the
    # dropout's stream (multistep.compiler.streams), so an evaluation through the original
    # op between compiled runs draws what the program as written draws there, and the
    # compiled steps after it too. (On the previous main: the evaluations drew the op's
    # 1st and 2nd draws, not the program's 4th and 8th, and the build warned.)
    def program():
        v1.set_random_seed(3)
        w = v1.get_variable("w", [4, 2], initializer=v1.ones_initializer())
        hidden = tf.nn.dropout(tf.ones([5, 4]) @ w, rate=0.5)
        loss = tf.reduce_mean(tf.square(hidden - 1.0))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return w, hidden, loss, train, v1.global_variables_initializer()

    with tf.Graph().as_default():  # as written: 3 steps, an evaluation, twice
        w, hidden, loss, train, init = program()
        with v1.Session() as plain:
            plain.run(init)
            want = []
            for _ in range(2):
                want += [plain.run([loss, train])[0] for _ in range(3)]
                want += [plain.run(hidden), plain.run(w)]
    with tf.Graph().as_default():
        w, hidden, loss, train, init = program()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            fused = ms.compile([loss, train], steps=3)
            with v1.Session() as sess:
                sess.run(init)
                got = []
                for _ in range(2):
                    got += list(fused.run(sess)[0]) + [sess.run(hidden), sess.run(w)]
    assert [np.asarray(g).tobytes() for g in got] == [np.asarray(x).tobytes() for x in want]


@pytest.mark.parametrize("use_resource,mode", [(False, "unrolled"), (True, "while_loop")])
def test_r6_02_a_weight_copied_beside_its_apply_is_refused(use_resource, mode):
    # a target network's copy grouped with the train op: the copy takes the weight before
    # or after the apply, run by run (a ref variable's Assign reads it as its own input)
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        online = v1.get_variable("online", [3, 1], initializer=v1.ones_initializer(),
                                 use_resource=use_resource)
        target = v1.get_variable("target", [3, 1], initializer=v1.zeros_initializer(),
                                 trainable=False, use_resource=use_resource)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, online) - 1.0))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        racy = tf.group(train, target.assign(online))
        with pytest.raises(ValueError, match=r"reads 'online' in .* no order against the "
                                             r"step's write of it in 'GradientDescent"):
            ms.compile([loss, racy], steps=2, mode=mode)
        with tf.control_dependencies([train]):  # ordered: compiles
            ordered = target.assign(online)
        ms.compile([loss, ordered], steps=2, mode=mode)
