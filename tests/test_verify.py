"""ms.verify: it passes on a correct model and names the run and variable of a wrong one."""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
X = np.random.RandomState(1).randn(6, 3).astype(np.float32)
Y = np.array([0, 1, 1, 0, 1, 0], np.int32)


def loss_of(w):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=Y, logits=tf.matmul(X, w)))


def weights():
    return V1.get_variable("w", [3, 2], initializer=V1.random_normal_initializer(seed=3))


def good_build(steps):
    return ms.unroll(lambda: loss_of(weights()), V1.train.MomentumOptimizer(0.5, 0.9), steps,
                     global_step=V1.train.get_or_create_global_step()), {}


def naive_build(steps):
    """The recipe the library exists to replace: logits built once, N chained applies."""
    loss = loss_of(weights())
    optimizer = V1.train.GradientDescentOptimizer(0.5)
    train_op = None
    for _ in range(steps):
        with tf.control_dependencies([train_op] if train_op is not None else []):
            train_op = optimizer.minimize(loss)
    return types.SimpleNamespace(train_op=train_op, losses=tf.stack([loss] * steps)), {}


def test_correct_model_verifies_bitwise():
    report = ms.verify(good_build, steps=3, runs=4)
    assert report.ok and report.bitwise
    assert report.max_abs_diff == 0.0
    assert report.first_divergence is None
    assert set(report.per_variable) == {"w", "w/Momentum", "global_step", "losses"}
    assert report.fused_losses.shape == (12,)
    assert report.final_values["global_step"] == 12
    assert "OK" in str(report) and "w/Momentum" in str(report)


def test_random_initial_values_are_copied_across():
    # good_build draws w randomly; a seedless initializer would differ between graphs.
    def build(steps):
        w = V1.get_variable("w", [3, 2], initializer=V1.random_normal_initializer())
        return ms.unroll(lambda: loss_of(w), V1.train.AdamOptimizer(0.1), steps), {}

    assert ms.verify(build, steps=2, runs=2).ok


def test_naive_recipe_is_caught_with_run_and_variable():
    report = ms.verify(naive_build, steps=3, runs=2)
    assert not report.ok
    assert report.first_divergence == (1, "w")
    assert report.per_variable["w"] > 1e-3
    assert report.per_variable["losses"] > 1e-3
    text = str(report)
    assert "DIVERGED" in text and "first divergence in run 1 (global steps 1-3) at 'w'" in text


def test_atol_allows_a_stated_tolerance():
    # atol is the argument under test, not a rounding bound: it must exceed any gap the naive
    # recipe can open, on any machine. A step moves w by lr |mean_i x_ij (p_ik - y_ik)| <=
    # lr max|X| per entry, so over 2 steps both runs stay within 2 lr max|X| of the start and
    # within d = 4 lr max|X| of each other; a logit then moves <= 3 max|X| d and the mean
    # cross-entropy <= 2 * 3 max|X| d (its gradient in the logits has l1 norm <= 2). Was 10.0,
    # below the loss bound (~64; the gap this recipe opens here is 0.77).
    d = 4 * 0.5 * np.abs(X).max()
    # The larger of the two bounds just derived, for w and for the losses:
    report = ms.verify(naive_build, steps=2, runs=1, atol=max(d, 6 * np.abs(X).max() * d))
    assert report.ok and not report.bitwise and report.max_abs_diff > 0


def test_per_run_feeds():
    data = np.random.RandomState(2).randn(12, 6, 3).astype(np.float32)

    def build(steps):
        xs = V1.placeholder(tf.float32, [steps, 6, 3])
        unrolled = ms.unroll(lambda x: tf.reduce_mean(tf.matmul(x, weights()) ** 2),
                             V1.train.AdagradOptimizer(0.1), steps, inputs=(xs,))
        return unrolled, lambda run: {xs: data[run * steps:(run + 1) * steps]}

    report = ms.verify(build, steps=4, runs=3)
    assert report.ok and report.bitwise
    # The batches really differ per step: a constant feed would give equal first losses.
    assert len(set(report.fused_losses.tolist())) == 12


def test_unnamed_keras_layers_are_matched_by_role():
    def build(steps):
        layer = keras.layers.Dense(2)  # numbered per process: dense_7, dense_8, ...
        return ms.unroll(lambda: tf.reduce_sum(layer(X)), V1.train.GradientDescentOptimizer(0.1), steps), {}

    report = ms.verify(build, steps=2)
    assert report.ok and report.bitwise and len(report.per_variable) == 3  # kernel, bias, losses


def test_builds_whose_variables_differ_get_a_clear_error():
    def build(steps):
        w = V1.get_variable("w", initializer=1.0)
        if steps > 1:
            V1.get_variable("only_in_the_fused_build", initializer=0.0)
        return ms.unroll(lambda: w * w, V1.train.GradientDescentOptimizer(0.1), steps), {}

    with pytest.raises(ValueError, match="different variables.*only_in_the_fused_build"):
        ms.verify(build, steps=2)


def test_keras3_dropout_seed_state_is_matched_by_role():
    def build(steps):
        drop = keras.layers.Dropout(0.5, seed=3, name="drop")  # seed_generator, seed_generator_1, ...
        dense = keras.layers.Dense(2, name="dense", kernel_initializer="ones")
        return ms.unroll(lambda: tf.reduce_sum(tf.square(dense(drop(X, training=True)))),
                         V1.train.GradientDescentOptimizer(0.1), steps, update_ops="all"), {}

    report = ms.verify(build, steps=3, runs=2)
    assert report.ok and report.bitwise, report.summary()
    assert any(name.endswith("seed_generator_state") for name in report.per_variable)


def test_verify_initialises_tables_and_iterators_as_a_monitored_session_would():
    def build(steps):
        table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            tf.constant([3, 5], tf.int64), tf.constant([0.5, 2.0])), default_value=0.0)
        data = tf.data.Dataset.from_tensor_slices(np.array([3, 5, 5, 3, 7, 5] * 4, np.int64))
        iterator = V1.data.make_initializable_iterator(data)
        w = V1.get_variable("w", initializer=1.0)
        return ms.unroll(lambda key: w * w * table.lookup(key), V1.train.GradientDescentOptimizer(0.1),
                         steps, inputs=iterator), {}

    report = ms.verify(build, steps=3, runs=2)
    assert report.ok and report.bitwise, report.summary()
    assert report.fused_losses[0] == 0.5  # looked up: key 3 -> 0.5, w = 1


DATA = np.arange(24, dtype=np.float32).reshape(12, 2) / 10  # 6 batches of 2: 2 runs of 3 steps


def dataset_loss(w):
    return lambda x: tf.reduce_sum(tf.square(tf.linalg.matvec(x, w) - 1.0))


def fed_dataset_build(steps, feed="dict"):
    """An iterator over a dataset made from a placeholder, whose value is in the feed."""
    data = V1.placeholder(tf.float32, [None, 2], name="data")
    iterator = V1.data.make_initializable_iterator(tf.data.Dataset.from_tensor_slices(data).batch(2))
    w = V1.get_variable("w", [2], initializer=V1.ones_initializer())
    feeds = {"dict": {data: DATA}, "callable": lambda run: {data: DATA}, "none": {}}
    return ms.unroll(dataset_loss(w), V1.train.GradientDescentOptimizer(0.01), steps,
                     inputs=iterator), feeds[feed]


@pytest.mark.parametrize("feed", ["dict", "callable"])
def test_an_iterator_over_a_fed_placeholder_is_initialised_with_the_feed(feed):
    report = ms.verify(lambda steps: fed_dataset_build(steps, feed), steps=3, runs=2)
    assert report.ok and report.bitwise, report.summary()
    # Reference: gradient descent in float64 over the 6 batches in order.
    w, losses = np.ones(2), []
    for x in DATA.astype(np.float64).reshape(6, 2, 2):
        r = x @ w - 1.0
        losses.append(np.sum(r * r))
        w = w - 0.01 * 2.0 * x.T @ r
    # float32 (the model) against float64 (this reference), u = 2**-24: here |x| <= 2.3,
    # |w| <= 3 and |r| <= 3.5. A step rounds r within 3u(|x0 w0| + |x1 w1| + 1) <= 45u and
    # its update 0.02 x^T r within 9u, and amplifies an earlier error in w at most
    # 1 + 0.02 * 2 * |x|^2 <= 1.42 times: over 6 steps |Δw| <= 6 * 9u * 1.42**6 < 3e-5, and
    # |Δloss| <= 4 |r| (|x| |Δw| + 45u) < 2e-3. (Unfed data, all zeros, would leave w at 1:
    # 0.1 and more away from the reference.)
    np.testing.assert_allclose(report.fused_losses, losses, rtol=0, atol=2e-3)  # |Δloss| bound above
    np.testing.assert_allclose(report.final_values["w"], w, rtol=0, atol=3e-5)  # 6 * 9u * 1.42**6 < 3e-5


def test_an_iterator_whose_placeholder_is_not_fed_is_refused_by_name():
    with pytest.raises(ValueError, match=r"need placeholder\(s\) \['data'\] fed, and the feed "
                                         r"build_fn returned does not give them\. Return"):
        ms.verify(lambda steps: fed_dataset_build(steps, "none"), steps=3, runs=2)


def random_pipeline_build(steps, pipeline, graph_seed=None):
    if graph_seed is not None:
        V1.set_random_seed(graph_seed)
    w = V1.get_variable("w", [2], initializer=V1.ones_initializer())
    data = pipeline(tf.data.Dataset.from_tensor_slices(DATA)).batch(2)
    return ms.unroll(dataset_loss(w), V1.train.GradientDescentOptimizer(0.01), steps,
                     inputs=V1.data.make_initializable_iterator(data)), {}


def unseeded_shuffle(data):
    return data.shuffle(12)


def unseeded_augmentation(data):
    return data.map(lambda x: x + tf.random.uniform([2]))


@pytest.mark.parametrize("pipeline,named", [
    (unseeded_shuffle, "ShuffleDataset 'ShuffleDataset' without a seed"),
    (unseeded_augmentation, "RandomUniform in Dataset_map_lambda without a seed")])
def test_an_unseeded_input_pipeline_is_named_as_the_cause(pipeline, named):
    report = ms.verify(lambda steps: random_pipeline_build(steps, pipeline), steps=3, runs=2)
    assert not report.ok  # still no pass: the runs did differ
    summary = report.summary()
    assert "DIVERGED" in summary
    assert "data order: the two builds read their data in different orders" in summary
    assert named in report.data_order and "dataset.shuffle(buffer, seed=0)" in report.data_order
    assert "tf.compat.v1.set_random_seed(0) inside build_fn" in report.data_order


@pytest.mark.parametrize("pipeline,graph_seed", [
    (lambda data: data.shuffle(12, seed=3), None), (unseeded_shuffle, 3), (unseeded_augmentation, 3)])
def test_a_seeded_input_pipeline_reads_alike_in_both_builds(pipeline, graph_seed):
    # A graph-level seed set inside build_fn is enough: each build's fresh graph gets it.
    report = ms.verify(lambda steps: random_pipeline_build(steps, pipeline, graph_seed), steps=3, runs=2)
    assert report.ok and report.bitwise and report.data_order is None, report.summary()


@pytest.mark.parametrize("returned", [None, "x", (1, 2, 3)])
def test_build_fn_must_return_unrolled_and_feed(returned):
    with pytest.raises(TypeError, match=r"build_fn\(.\) must return \(unrolled, feed_dict\)|needs .train_op"):
        ms.verify(lambda steps: returned, steps=2)


@pytest.mark.parametrize("kwargs,error", [({"steps": 0}, ValueError), ({"steps": "2"}, TypeError),
                                          ({"steps": 2, "runs": 0}, ValueError),
                                          ({"steps": 2, "atol": -1.0}, ValueError)])
def test_bad_arguments(kwargs, error):
    with pytest.raises(error, match="steps|runs|atol"):
        ms.verify(good_build, **kwargs)


def relu_layer_build(steps):
    """A dense ReLU layer. Its fused build (steps > 1) puts a control input on the MatMul,
    which stops Grappler's remapper from fusing MatMul + BiasAdd + Relu: the cause the
    issue found in ref-variable steps, forced here."""
    x = V1.placeholder_with_default(X, [6, 3])
    w = V1.get_variable("w", [3, 2], initializer=V1.random_normal_initializer(seed=3))
    b = V1.get_variable("b", [2], initializer=V1.zeros_initializer())

    def loss_fn():
        w_value = w.read_value()  # read outside the block: the block's control input goes
        # on the MatMul itself (on a read of b: Grappler drops one on a NoOp).
        with tf.control_dependencies([b.read_value()] if steps > 1 else []):
            h = tf.matmul(x, w_value)
        return tf.reduce_sum(tf.square(tf.nn.relu(tf.nn.bias_add(h, b))))

    return ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.01), steps), {}


def test_explain_names_the_first_kernel_that_differs():
    report = ms.verify(relu_layer_build, steps=3, runs=1, explain=True)
    assert report.same_kernels is False
    text = str(report.kernels)
    # Step 1 already has the control input; the single step fused the three ops into the
    # kernel named after the last of them (oneDNN on: _MklNativeFusedMatMul; off: _FusedMatMul).
    # (The kernels are listed by name within the step.)
    assert text.startswith("step 1 ran forward/BiasAdd as BiasAdd, forward/MatMul as "), text
    assert "forward/Relu as Relu" in text, text
    assert "a single step ran forward/Relu as " in text and "FusedMatMul(BiasAdd, Relu)" in text, text
    assert "kernels differ: step 1 ran" in report.summary()


def test_explain_says_same_kernels_on_a_correct_build():
    report = ms.verify(good_build, steps=3, runs=2, explain=True)
    assert report.ok and report.same_kernels is True and report.kernels is None
    assert "kernels: same kernels in every inner step as in a single step" in report.summary()
    quiet = ms.verify(good_build, steps=3, runs=2)  # without explain: said only when they differ
    assert quiet.same_kernels is True and "kernels" not in quiet.summary()


def test_a_divergence_reports_the_kernels_without_being_asked():
    report = ms.verify(naive_build, steps=3, runs=2)
    assert not report.ok
    # naive_build is not ms.unroll's: no step scopes to read the kernels of.
    assert report.same_kernels is None and "kernels: not compared" in report.summary()


def test_an_input_that_runs_out_says_so():
    """6 batches, 2 runs of 4 steps: the second fused run finds 2 of its 4 batches."""
    with pytest.raises(ValueError, match=r"the input ran out in run 2 of 2: each build makes "
                                         r"steps x runs = 8 steps"):
        ms.verify(lambda steps: fed_dataset_build(steps, "dict"), steps=4, runs=2)


def test_verify_takes_booleans_for_xla_and_explain():
    """Issue 28: xla="yes" was taken as true."""
    with pytest.raises(TypeError, match="verify: xla must be True or False, got 'yes'"):
        ms.verify(good_build, steps=2, xla="yes")
    with pytest.raises(TypeError, match="verify: explain must be True or False, got 1"):
        ms.verify(good_build, steps=2, explain=1)


def test_explain_under_xla_says_what_it_compared():
    """Issue 28: explain=True printed no kernel line under XLA (the XLA line took its place)."""
    report = ms.verify(good_build, steps=2, runs=1, xla=True, explain=True)
    assert report.ok, report.summary()
    assert "against plain single steps (no XLA)" in report.summary()
    assert "kernels: not compared (no inner step's kernels in the partition graphs: the steps " \
           "ran inside one XLA program" in report.summary()
