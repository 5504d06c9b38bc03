"""ms.tf2: N steps in one tf.function call against N single calls of tf.function(step),
written here without multistep; and the traps ms.tf2.check finds."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

STEPS, CALLS = 4, 2
_rng = np.random.RandomState(0)
X = _rng.randn(STEPS * CALLS, 8, 4).astype(np.float32)
Y = _rng.randint(0, 3, (STEPS * CALLS, 8)).astype(np.int32)
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=3, decay_rate=0.5)),
}


def keras_step(layer, optimizer):
    """A Keras 3 model (Dense, then ``layer``: none, BatchNormalization or a seeded
    Dropout), built from seed 1, and its training step as a TF2 user writes it."""
    keras.utils.set_random_seed(1)
    extra = {"dense": [], "batch_norm": [keras.layers.BatchNormalization()],
             "dropout": [keras.layers.Dropout(0.3, seed=3)]}[layer]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                              *extra, keras.layers.Dense(3)])
    opt = OPTIMIZERS[optimizer]()
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            loss = xent(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss, "grad_norm": tf.linalg.global_norm(grads)}

    return model, opt, step


CASES = [  # layer, optimizer, inputs, jit_compile: each layer, optimizer, input kind, jit
    ("dense", "sgd_momentum", "stacked", False),
    ("dense", "adam_schedule", "dataset", True),
    ("batch_norm", "adam", "stacked", True),
    ("batch_norm", "sgd_momentum", "dataset", False),
    ("dropout", "adam_schedule", "stacked", False),
    ("dropout", "adam", "dataset", True),
]


@pytest.mark.parametrize("layer,optimizer,inputs,jit", CASES)
def test_fused_steps_are_bitwise_the_single_calls(layer, optimizer, inputs, jit):
    model, opt, step = keras_step(layer, optimizer)
    fused = ms.tf2.fuse(step, STEPS, jit_compile=jit)
    if inputs == "stacked":
        outs = [fused((X[c * STEPS:(c + 1) * STEPS], Y[c * STEPS:(c + 1) * STEPS]))
                for c in range(CALLS)]
    else:
        iterator = iter(tf.data.Dataset.from_tensor_slices((X, Y)))
        outs = [fused(iterator) for _ in range(CALLS)]
    got = {key: np.concatenate([o[key].numpy() for o in outs]) for key in outs[0]}
    got_values = [v.numpy() for v in model.variables + opt.variables]

    model, opt, step = keras_step(layer, optimizer)  # the reference: single calls
    single = tf.function(step, jit_compile=jit)
    want = [single((X[i], Y[i])) for i in range(STEPS * CALLS)]
    assert sorted(got) == ["grad_norm", "iteration", "loss"]
    for key in ("loss", "grad_norm"):
        assert np.array_equal(got[key], [w[key].numpy() for w in want]), key
    assert got["iteration"].tolist() == list(range(1, STEPS * CALLS + 1))
    want_values = [v.numpy() for v in model.variables + opt.variables]
    assert len(got_values) == len(want_values)
    for a, b in zip(got_values, want_values):
        assert np.array_equal(a, b)


def test_verify_reports_bitwise_and_leaves_the_model_as_it_was():
    model, opt, step = keras_step("batch_norm", "adam")
    fused = ms.tf2.fuse(step, STEPS)
    fused((X[:STEPS], Y[:STEPS]))  # trained a little first: verify starts from here
    before = [v.numpy() for v in model.variables + opt.variables]
    report = ms.tf2.verify(step, STEPS, batches=(X, Y), calls=CALLS)
    assert report.ok and report.bitwise, str(report)
    assert "iteration" in report.per_variable and "losses" in report.per_variable
    after = [v.numpy() for v in model.variables + opt.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def cached_gradient_step():
    """A step that keeps a gradient in a Python cache at its first trace: with two traces
    (step 1, then the loop body) the body captured the first trace's gradient, computed
    once before the loop and applied at every step. Traced once, it is computed in the
    step, as a single tf.function's one trace computes it at every call."""
    w = tf.Variable([1.0, -2.0])
    opt = keras.optimizers.SGD(0.1)
    cache = {}

    def step(batch):
        if "grads" not in cache:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * w * batch)
            cache["grads"], cache["loss"] = tape.gradient(loss, w), loss
        opt.apply_gradients([(cache["grads"], w)])
        return cache["loss"]

    return w, step


def cached_l2_step():
    """The weights' L2 term kept in a Python cache at the first trace."""
    w = tf.Variable([1.0, -2.0])
    opt = keras.optimizers.SGD(0.1)
    cache = {}

    def step(batch):
        if "l2" not in cache:
            cache["l2"] = 0.01 * tf.reduce_sum(w * w)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * batch) + cache["l2"]
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    return w, step


@pytest.mark.parametrize("make", [cached_gradient_step, cached_l2_step])
def test_state_cached_at_the_first_trace_is_computed_at_every_step(make):
    """step_fn traced once for all N steps (issue 29), in the loop body: nothing of it is
    computed before the loop, so nothing is stale and the fused steps are bitwise N calls
    of the single tf.function, which also traces the step once (before: refused as stale,
    or with check=False every step applied step 1's gradient)."""
    w, step = make()
    out = ms.tf2.fuse(step, STEPS)(tf.ones([STEPS, 2]))  # (check=True: nothing stale)
    reference, single = make()
    single = tf.function(single, autograph=False)
    want = [single(tf.ones([2])).numpy() for _ in range(STEPS)]
    assert out["loss"].numpy().tobytes() == np.array(want, np.float32).tobytes()
    assert w.numpy().tobytes() == reference.numpy().tobytes()


def seeded_random_step():
    """tf.nn.dropout and tf.random.normal with op seeds (stateful kernels: each draws the
    next numbers of its stream at every call)."""
    keras.utils.set_random_seed(1)
    tf.random.set_seed(3)
    first, second = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)
    model = keras.Sequential([keras.Input((4,)), first, second])
    opt = keras.optimizers.Adam(0.01)

    def step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            h = tf.nn.dropout(first(x), rate=0.5, seed=7)
            noise = tf.random.normal([1], seed=11)
            loss = tf.reduce_mean(tf.square(second(h) - tf.cast(y[:, None], tf.float32)))
            loss += 0.01 * noise[0]
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    return model, step


def test_stateful_random_ops_draw_the_single_calls_stream():
    """One trace, so one kernel of each random op, run once a step as N calls of the single
    tf.function run theirs: bitwise (issue 29: traced twice, the steps after the first drew
    from a second kernel, losses 0.12-0.59 off)."""
    reference, step = seeded_random_step()
    single = tf.function(step, autograph=False)
    want = [single((X[i], Y[i])).numpy() for i in range(2 * STEPS)]
    model, step = seeded_random_step()
    fused = ms.tf2.fuse(step, STEPS)
    got = [fused((X[r * STEPS:(r + 1) * STEPS], Y[r * STEPS:(r + 1) * STEPS]))["loss"].numpy()
           for r in range(2)]
    assert np.concatenate(got).tobytes() == np.array(want, np.float32).tobytes()
    for a, b in zip(model.variables, reference.variables):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path


def test_check_reports_a_frozen_eager_value():
    w = tf.Variable([1.0, -2.0])
    opt = keras.optimizers.SGD(0.1)
    with tf.GradientTape() as tape:  # eagerly, before fusing: a constant of the trace
        frozen_grad = tape.gradient(tf.reduce_sum(w * w), w)

    def step(batch):
        opt.apply_gradients([(frozen_grad * batch, w)])
        return tf.reduce_sum(w)

    findings = ms.tf2.check(ms.tf2.fuse(step, STEPS), tf.ones([STEPS, 2]))
    assert [f.kind for f in findings] == ["frozen"], findings
    assert "shape (2,), float32" in str(findings[0])
    line = step.__code__.co_firstlineno + 1  # where the loop uses it
    assert f"at {__file__}:{line} (in step)" in str(findings[0])

    @tf.function
    def loop(n):  # the same step in a hand-written loop: found through the function it calls
        for _ in tf.range(n):
            step(1.0)
    assert [f.kind for f in ms.tf2.check(loop, tf.constant(2))] == ["frozen"]


class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The Transformer tutorial's schedule, as written there: ``d_model`` held as an eager
    float tensor, which the fused loop captures."""

    def __init__(self, d_model, warmup_steps=4000):
        self.d_model = tf.cast(d_model, tf.float32)
        self.warmup_steps = warmup_steps

    def __call__(self, step):
        step = tf.cast(step, dtype=tf.float32)
        arg1 = tf.math.rsqrt(step)
        arg2 = step * (self.warmup_steps ** -1.5)
        return tf.math.rsqrt(self.d_model) * tf.math.minimum(arg1, arg2)


def test_a_transformer_schedule_is_a_constant_not_a_finding_and_fuses_bitwise():
    """Issue 29: check reported the schedule's ``tf.cast(d_model)`` as frozen, named after
    Adam's op. A tensor the optimizer's schedule holds is a constant by design: no
    finding, through fuse or a hand-written loop; fused bitwise with single calls."""
    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        opt = keras.optimizers.Adam(TransformerSchedule(64), beta_2=0.98, epsilon=1e-9)
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def step(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = xent(y, model(x))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss
        return model, step

    model, step = build()
    fused = ms.tf2.fuse(step, STEPS)
    assert ms.tf2.check(fused, (X[:STEPS], Y[:STEPS])) == []

    @tf.function
    def loop(x, y):
        for k in tf.range(STEPS):
            step((x[k], y[k]))
    assert ms.tf2.check(loop, X[:STEPS], Y[:STEPS]) == []

    model, step = build()
    got = ms.tf2.fuse(step, STEPS)((X[:STEPS], Y[:STEPS]))["loss"].numpy()
    reference, single = build()
    single = tf.function(single)
    want = np.array([single((X[k], Y[k])).numpy() for k in range(STEPS)])
    assert got.tobytes() == want.tobytes(), (got, want)
    for a, b in zip(model.variables, reference.variables):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path


def test_check_reports_python_state_that_each_trace_freezes():
    w = tf.Variable(1.0)
    opt = keras.optimizers.SGD(0.1)
    counter = [0]

    def step(batch):
        counter[0] += 1  # Python: frozen at each trace
        with tf.GradientTape() as tape:
            loss = w * w * batch * float(counter[0])
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    findings = ms.tf2.check(ms.tf2.fuse(step, STEPS), tf.ones([STEPS]))
    assert [f.kind for f in findings] == ["python_state"], findings
    assert "in one trace and" in str(findings[0])
    line = step.__code__.co_firstlineno + 3  # the line that reads it
    assert f"at {__file__}:{line} (in step)" in str(findings[0])


@pytest.mark.parametrize("layer", ["dense", "batch_norm", "dropout"])
def test_check_finds_nothing_in_a_correct_loop(layer):
    model, opt, step = keras_step(layer, "adam_schedule")
    assert ms.tf2.check(ms.tf2.fuse(step, STEPS), (X[:STEPS], Y[:STEPS])) == []


def test_check_takes_a_hand_written_tf_range_loop_and_names_the_line():
    """Issue 29: check refused a user's own tf.function training loop, where the stale
    trap lives for those who wrote the loop themselves. The logits computed once before
    the loop are found, naming the line that built them; the loop that computes them
    inside finds nothing."""
    w = tf.Variable(tf.ones([4, 3]))
    opt = keras.optimizers.SGD(0.1)
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def stale(n, x, y):
        logits = x @ w  # built once, before the loop: every step reuses it
        for _ in tf.range(n):
            with tf.GradientTape() as tape:
                tape.watch(w)
                loss = xent(y, logits) + 0.0 * tf.reduce_sum(w)
            opt.apply_gradients([(tape.gradient(loss, w), w)])

    @tf.function
    def correct(n, x, y):
        for _ in tf.range(n):
            with tf.GradientTape() as tape:
                loss = xent(y, x @ w)
            opt.apply_gradients([(tape.gradient(loss, w), w)])

    line = stale.python_function.__code__.co_firstlineno + 2
    findings = ms.tf2.check(stale, tf.constant(3), X[0], Y[0])
    assert [f.kind for f in findings] == ["stale"], findings
    assert f"at {__file__}:{line} (in stale)" in str(findings[0])
    assert ms.tf2.check(correct, tf.constant(3), X[0], Y[0]) == []
    with pytest.raises(TypeError, match="a tf.function with a loop"):
        ms.tf2.check(lambda n: n, 3)
    with pytest.raises(ValueError, match="has no tf.while_loop"):
        ms.tf2.check(tf.function(lambda n: n + 1), tf.constant(3))


def test_a_second_trace_is_refused_before_anything_runs():
    model, opt, step = keras_step("dense", "adam")
    fused = ms.tf2.fuse(step, STEPS)
    fused((X[:STEPS], Y[:STEPS]))
    before = [v.numpy() for v in model.variables]
    with pytest.raises(RuntimeError, match="would trace the fused steps again"):
        fused((X[:STEPS, :4], Y[:STEPS, :4]))  # another batch size
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))


def test_a_short_last_block_runs_its_true_length_without_a_retrace():
    model, opt, step = keras_step("dense", "sgd_momentum")
    fused = ms.tf2.fuse(step, 3)
    iterator = iter(tf.data.Dataset.from_tensor_slices((X, Y)))  # 8 elements: 3 + 3 + 2
    fused(iterator)
    traces = fused._traces  # (the first call may trace twice: once to create the variables)
    fused(iterator)
    with pytest.warns(RuntimeWarning, match="ran 2 of its 3 steps"):
        last = fused(iterator)
    assert last["loss"].shape == (2,) and last["iteration"].numpy().tolist() == [7, 8]
    assert fused._traces == traces
    with pytest.raises(tf.errors.OutOfRangeError):
        fused(iterator)


def test_a_keras_models_own_train_step():
    """``fuse(model.train_step, N)``: its optimizer is found as ``self.optimizer``."""
    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model = build()
    out = ms.tf2.fuse(model.train_step, STEPS)((X[:STEPS], Y[:STEPS]))
    reference = build()
    single = tf.function(reference.train_step)
    want = [single((X[i], Y[i]))["loss"].numpy() for i in range(STEPS)]
    assert np.array_equal(out["loss"].numpy(), want)
    assert out["iteration"].numpy().tolist() == [1, 2, 3, 4]
    for a, b in zip(model.variables, reference.variables):
        assert np.array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("kwargs,error", [
    ({"steps": 0}, ValueError), ({"steps": 2.5}, ValueError), ({"jit_compile": "yes"}, TypeError),
])
def test_bad_arguments(kwargs, error):
    options = {"steps": 2, **kwargs}
    with pytest.raises(error):
        ms.tf2.fuse(lambda batch: tf.constant(0.0), options.pop("steps"), **options)
    with pytest.raises(TypeError, match="step_fn must be callable"):
        ms.tf2.fuse(tf.constant(1.0), 2)
    with pytest.raises(ValueError, match="leading dimension of steps=2"):
        ms.tf2.fuse(lambda batch: tf.reduce_sum(batch), 2)(tf.ones([3, 1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="calls must be an int >= 1"):
            ms.tf2.verify(lambda batch: tf.reduce_sum(batch), 2, batches=tf.ones([2]), calls=0)


MIRRORED = """
import numpy as np, tensorflow as tf, keras
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import multistep as ms

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.RandomState(0)
X = rng.randn(8, 8, 4).astype(np.float32)
Y = rng.randint(0, 3, (8, 8)).astype(np.int32)


def build(ready=True):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        opt = keras.optimizers.Adam(0.01)
        if ready:
            opt.build(model.trainable_variables)
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(xent(y, model(x, training=True)),
                                              global_batch_size=8)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return model, opt, step


model, opt, step = build()
fused = ms.tf2.fuse(step, 4, strategy=strategy)
got = np.concatenate([fused((X[:4], Y[:4]))["loss"].numpy(), fused((X[4:], Y[4:]))["loss"].numpy()])
got_values = [v.numpy() for v in model.variables + opt.variables]

reference, ref_opt, ref_step = build()  # a hand-written single strategy.run step


@tf.function
def single(x, y):
    def share(context):  # replica r: rows 4r..4r+3 of the step's batch of 8
        r = context.replica_id_in_sync_group
        return (x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4])
    per_replica = strategy.run(ref_step, (strategy.experimental_distribute_values_from_function(share),))
    return strategy.reduce("SUM", per_replica, axis=None)


want = np.array([single(X[i], Y[i]).numpy() for i in range(8)])
assert np.array_equal(got, want), (got, want)
for a, b in zip(got_values, [v.numpy() for v in reference.variables + ref_opt.variables]):
    assert np.array_equal(a, b)
# A distributed iterator: each element holds every replica's part (rows 4r..4r+3).
model, opt, step = build()
fused = ms.tf2.fuse(step, 4, strategy=strategy)
data = tf.data.Dataset.from_tensor_slices((X.reshape(64, 4), Y.reshape(64))).batch(8)
iterator = iter(strategy.experimental_distribute_dataset(data))
got = np.concatenate([fused(iterator)["loss"].numpy() for _ in range(2)])
assert np.array_equal(got, want), (got, want)
for a, b in zip([v.numpy() for v in model.variables + opt.variables],
                [v.numpy() for v in reference.variables + ref_opt.variables]):
    assert np.array_equal(a, b)
model, opt, step = build(ready=False)
try:
    ms.tf2.fuse(step, 4, strategy=strategy)((X[:4], Y[:4]))
except ValueError as error:
    assert "optimizer.build(model.trainable_variables)" in str(error), error
else:
    raise AssertionError("a step creating variables under a strategy was not refused")
print("bitwise")
"""


def test_under_a_mirrored_strategy_bitwise_the_single_strategy_run_steps():
    """Two logical CPUs (set before TensorFlow starts: a subprocess); each step's batch
    split between the replicas, the loop outside strategy.run."""
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", MIRRORED], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0 and "bitwise" in result.stdout, result.stderr[-3000:]


def test_jit_over_convolutions_on_the_cpu_says_what_it_costs():
    """Issue 29: XLA's CPU convolutions are not bitwise with TensorFlow's and were 2.4x to
    10x slower on the issue's conv models (4-5x in benchmarks/tf2_conv.py):
    fuse(jit_compile=True) says so at its first trace; without XLA, no warning."""
    def conv_step():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3)])
        opt = keras.optimizers.SGD(0.1)

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            return loss
        return step

    batches = tf.ones([2, 1, 4, 4, 1])
    with pytest.warns(RuntimeWarning, match=r"jit_compile=True on the CPU over a step with "
                                            r"convolutions \(Conv2D, Conv2DBackpropFilter.*several "
                                            r"times slower"):
        ms.tf2.fuse(conv_step(), 2, jit_compile=True)(batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ms.tf2.fuse(conv_step(), 2)(batches)


def test_jit_under_a_strategy_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="jit_compile=True under a tf.distribute strategy"):
        ms.tf2.fuse(lambda batch: batch, 2, jit_compile=True,
                    strategy=tf.distribute.get_strategy())


def gan_step():
    """The DCGAN tutorial's shape: noise drawn in the step (with an op seed), two
    optimizers, a step that returns nothing."""
    keras.utils.set_random_seed(2)
    tf.random.set_seed(5)
    generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    g_opt, d_opt = keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2)
    xent = keras.losses.BinaryCrossentropy(from_logits=True)

    def step(images):
        noise = tf.random.normal([8, 3], seed=9)
        with tf.GradientTape() as g_tape, tf.GradientTape() as d_tape:
            fake = generator(noise, training=True)
            real_out, fake_out = discriminator(images), discriminator(fake)
            g_loss = xent(tf.ones_like(fake_out), fake_out)
            d_loss = xent(tf.ones_like(real_out), real_out) + xent(tf.zeros_like(fake_out), fake_out)
        g_opt.apply_gradients(zip(g_tape.gradient(g_loss, generator.trainable_variables),
                                  generator.trainable_variables))
        d_opt.apply_gradients(zip(d_tape.gradient(d_loss, discriminator.trainable_variables),
                                  discriminator.trainable_variables))

    return generator.variables + discriminator.variables, step


def test_a_step_that_returns_nothing_is_fused_bitwise():
    """Issue 29: 'None values not supported' from TensorFlow's internals before."""
    images = X[:, :, :4]
    reference, step = gan_step()
    single = tf.function(step, autograph=False)
    for i in range(STEPS):
        single(images[i])
    variables, step = gan_step()
    assert ms.tf2.fuse(step, STEPS)(images[:STEPS]) == {}
    for a, b in zip(variables, reference):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path


def test_a_step_taking_x_and_y_gets_the_batch_items_and_its_iteration():
    """Issue 29: train_step(x, y) needed a lambda, which lost the 'iteration' output."""
    model, opt, _ = keras_step("dense", "sgd_momentum")
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):  # its optimizer found by name, as a one-argument step's is
        with tf.GradientTape() as tape:
            loss = xent(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    out = ms.tf2.fuse(train_step, STEPS)((X[:STEPS], Y[:STEPS]))
    assert out["iteration"].numpy().tolist() == [1, 2, 3, 4]
    reference, _, single = keras_step("dense", "sgd_momentum")
    single = tf.function(single, autograph=False)
    want = [single((X[i], Y[i]))["loss"].numpy() for i in range(STEPS)]
    assert out["loss"].numpy().tobytes() == np.array(want, np.float32).tobytes()
    for a, b in zip(model.variables, reference.variables):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path


def test_inputs_fuse_cannot_take_are_refused_by_name():
    model, opt, step = keras_step("dense", "sgd_momentum")
    fused = ms.tf2.fuse(step, STEPS)
    data = tf.data.Dataset.from_tensor_slices((X, Y))
    for batches, what in [(None, "None"), (data, "_TensorSliceDataset"),
                          ((b for b in [1]), "generator")]:
        with pytest.raises(TypeError, match=f"got {what}.*pass iter\\(dataset\\)"):
            fused(batches)
    with pytest.raises(TypeError, match="optimizer must be the optimizer step_fn applies.*got "
                                        "Sequential: pass model.optimizer"):
        ms.tf2.fuse(step, STEPS, optimizer=model)
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    with pytest.raises(TypeError, match="distributed iterator.*needs the strategy"):
        fused(iter(one.experimental_distribute_dataset(data.batch(2))))

    def branching(batch):
        if tf.reduce_sum(batch) > 0:  # a Python if on a tensor: needs AutoGraph
            return step((batch, Y[0]))
        return step((-batch, Y[0]))

    with pytest.raises(TypeError, match="without AutoGraph.*tf.cond"):
        ms.tf2.fuse(branching, STEPS)(X[:STEPS])


def unseeded_noise_step():
    """tf.random.normal without an op seed under a global seed (the DCGAN tutorial's
    noise): the kernel's seed is the global seed's, the same in any trace."""
    tf.random.set_seed(4)
    w = tf.Variable([1.0, 2.0])
    opt = keras.optimizers.SGD(0.1)

    def step(batch):
        noise = tf.random.normal([2])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * (batch + noise))
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    return w, step


def test_unseeded_noise_under_a_global_seed_is_bitwise():
    """Issue 29: traced twice, step 1 and the loop drew from two kernels (the DCGAN's
    losses equal at step 1, then 0.659 against 0.636); traced once, one kernel draws the
    single tf.function's stream."""
    reference, step = unseeded_noise_step()
    single = tf.function(step, autograph=False)
    want = [single(tf.ones([2])).numpy() for _ in range(2 * STEPS)]
    w, step = unseeded_noise_step()
    fused = ms.tf2.fuse(step, STEPS)
    got = np.concatenate([fused(tf.ones([STEPS, 2]))["loss"].numpy() for _ in range(2)])
    assert got.tobytes() == np.array(want, np.float32).tobytes()
    assert w.numpy().tobytes() == reference.numpy().tobytes()


def test_verify_atol_and_step_history_arguments_are_checked():
    """Issue 29: verify with a negative atol, StepHistory(callbacks=[print]) and
    StepHistory(log_dir=3) were taken silently."""
    with pytest.raises(ValueError, match="atol must be a number >= 0, got -1"):
        # (an invalid argument, refused: not a tolerance)
        ms.tf2.verify(lambda batch: tf.reduce_sum(batch), 2, batches=tf.ones([4]), atol=-1)
    with pytest.raises(TypeError, match=r"callbacks\[0\] must be a keras.callbacks.Callback"):
        ms.keras.StepHistory(callbacks=[print])
    with pytest.raises(TypeError, match="log_dir must be a directory path, got 3"):
        ms.keras.StepHistory(log_dir=3)


def test_a_short_batch_from_tf_data_is_trained_as_a_single_step():
    """Issue 29: batch(3) of 8 rows gives 3, 3 and 2 rows; at N = 3 the stack of unequal
    batches failed in TensorFlow ("Shapes of all inputs must match") with 3 batches taken
    and lost. Now the 2 steps before the short batch run fused, then the short batch runs
    as one step traced for its shapes, with a warning naming it: bitwise with 3 calls of
    a single-step tf.function (which retraces for the short batch too)."""
    rows_x, rows_y = X.reshape(-1, 4)[:8], Y.reshape(-1)[:8]
    data = tf.data.Dataset.from_tensor_slices((rows_x, rows_y)).batch(3)
    model, opt, step = keras_step("dense", "sgd_momentum")
    fused = ms.tf2.fuse(step, 3)
    iterator = iter(data)
    with pytest.warns(RuntimeWarning, match=r"next element has shapes \[\(2, 4\), \(2,\)\].*"
                                            r"drop_remainder=True.*ran the 2 step\(s\) before "
                                            r"it fused, then that element as one single step"):
        out = fused(iterator)
    assert out["iteration"].numpy().tolist() == [1, 2, 3]
    reference, _, single = keras_step("dense", "sgd_momentum")
    single = tf.function(single, autograph=False)
    want = [single(batch)["loss"].numpy() for batch in data]
    assert out["loss"].numpy().tobytes() == np.array(want, np.float32).tobytes()
    for a, b in zip(model.variables, reference.variables):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path
    with pytest.raises(tf.errors.OutOfRangeError):  # the short batch was the last
        fused(iterator)


def test_padded_batches_of_their_own_lengths_are_all_trained():
    """Issue 29: padded_batch of variable-length sequences crashed at the first call. Each
    element of other shapes than the fused steps' ends a call and runs as a single step:
    every element trained, bitwise with single calls, nothing lost."""
    lengths = [2, 2, 3, 3, 2, 2, 5, 5]
    data = tf.data.Dataset.from_generator(
        lambda: ((X[i, :n], Y[i, 0]) for i, n in enumerate(lengths)),
        output_signature=(tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([], tf.int32)))
    data = data.padded_batch(2)  # lengths 2, 3, 2, 5: each batch padded to its own longest

    def build():
        keras.utils.set_random_seed(1)
        dense = keras.layers.Dense(3)
        opt = keras.optimizers.SGD(0.1)
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def step(batch):
            x, y = batch
            with tf.GradientTape() as tape:
                loss = xent(y, tf.reduce_mean(dense(x), axis=1))
            opt.apply_gradients(zip(tape.gradient(loss, dense.trainable_variables),
                                    dense.trainable_variables))
            return loss
        return dense, step

    dense, step = build()
    fused = ms.tf2.fuse(step, 2)
    iterator, got = iter(data), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (each odd element says so)
        while True:
            try:
                got += fused(iterator)["loss"].numpy().tolist()
            except tf.errors.OutOfRangeError:
                break
    reference, single = build()
    single = tf.function(single, autograph=False)
    want = [single(batch).numpy() for batch in data]
    assert np.array(got, np.float32).tobytes() == np.array(want, np.float32).tobytes()
    for a, b in zip(dense.variables, reference.variables):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path


# Issue 39 (round 3): one test named for each case.


def single_calls(step, batches, count, jit_compile=False):
    """The reference: ``count`` calls of the user's step as a single-step tf.function."""
    single = tf.function(step, jit_compile=jit_compile)
    return [single(tf.nest.map_structure(lambda t: t[i], batches)) for i in range(count)]


def assert_same_variables(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_jit_over_stateful_random_ops_warns_at_the_first_call_naming_them_and_check_reports_it():
    """Case 1: under jit_compile=True, tf.random.normal and tf.nn.dropout drew other numbers
    fused than in N single XLA calls, with no word (main: no warning, check found
    nothing)."""
    _, step = seeded_random_step()
    fused = ms.tf2.fuse(step, STEPS, jit_compile=True)
    with pytest.warns(RuntimeWarning, match=r"jit_compile=True over a step with stateful random "
                                            r"ops \(.*RandomUniform.*RandomStandardNormal.*draw "
                                            r"other numbers than N single jit_compile=True calls"
                                            r".*fuse without jit_compile"):
        fused((X[:STEPS], Y[:STEPS]))
    findings = ms.tf2.check(fused, (X[:STEPS], Y[:STEPS]))
    assert [f.kind for f in findings] == ["random"]
    assert "RandomStandardNormal" in str(findings[0])
    with warnings.catch_warnings():  # the same step without XLA: no such word
        warnings.simplefilter("error", RuntimeWarning)
        _, step = seeded_random_step()
        fused = ms.tf2.fuse(step, STEPS)
        fused((X[:STEPS], Y[:STEPS]))
        assert ms.tf2.check(fused, (X[:STEPS], Y[:STEPS])) == []


class OwnOptimizerModel(keras.Model):
    """keras-io's custom train_step: trains through an optimizer of its own; compiled with
    a bare compile(), whose default optimizer it never uses."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.own_optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        self.xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.xent(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.own_optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def own_optimizer_model():
    keras.utils.set_random_seed(1)
    model = OwnOptimizerModel()
    model.build((None, 4))
    model.compile()
    return model


def test_a_train_step_through_its_own_optimizer_reports_that_optimizers_iteration():
    """Case 2: main reported the unused default optimizer's iteration, [0, 0, 0, 0]."""
    model = own_optimizer_model()
    out = ms.tf2.fuse(model.train_step, STEPS)((X[:STEPS], Y[:STEPS]))
    assert out["iteration"].numpy().tolist() == [1, 2, 3, 4]
    reference = own_optimizer_model()
    want = single_calls(reference.train_step, (X, Y), STEPS)
    np.testing.assert_array_equal(out["loss"].numpy(), [w["loss"].numpy() for w in want])
    assert_same_variables(model.variables, reference.variables)


def tf_function_step():
    model, opt, step = keras_step("dense", "adam")
    return model, tf.function(step)  # decorated, as 3 of the 10 programs do


def test_a_tf_function_step_gets_its_iteration_output():
    """Case 2: main found no optimizer in a tf.function (no 'iteration', no word why)."""
    model, step = tf_function_step()
    out = ms.tf2.fuse(step, STEPS)((X[:STEPS], Y[:STEPS]))
    assert out["iteration"].numpy().tolist() == [1, 2, 3, 4]
    reference, single = tf_function_step()
    want = [single((X[i], Y[i])) for i in range(STEPS)]  # the user's own tf.function
    np.testing.assert_array_equal(out["loss"].numpy(), [w["loss"].numpy() for w in want])
    assert_same_variables(model.variables, reference.variables)


def x_y_step():
    model, opt, _ = keras_step("dense", "sgd_momentum")
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = xent(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    return model, train_step


def test_check_and_verify_take_a_train_step_of_x_and_y():
    """Case 3: main: "missing a required argument: 'y'" from both."""
    model, train_step = x_y_step()
    assert ms.tf2.check(ms.tf2.fuse(train_step, STEPS), (X[:STEPS], Y[:STEPS])) == []
    report = ms.tf2.verify(train_step, STEPS, batches=(X, Y), calls=CALLS)
    assert report.bitwise and report.first_divergence is None
    assert report.per_variable["iteration"] == 0.0  # the found optimizer's, compared too


def test_verify_a_step_that_returns_nothing():
    """Case 3: main: KeyError: 'loss'."""
    _, _, step = keras_step("dropout", "adam")

    def quiet(batch):  # trains, returns nothing
        step(batch)

    report = ms.tf2.verify(quiet, STEPS, batches=(X, Y), calls=CALLS)
    assert report.bitwise and report.first_divergence is None
    assert report.fused_losses.shape == (0,)


def two_losses_step():
    """WGAN-GP's and keras-io's DCGAN's train_step shape: logs without a 'loss' key."""
    model, opt, step = keras_step("dropout", "adam")

    def train_step(batch):
        logs = step(batch)
        return {"d_loss": logs["loss"], "g_loss": logs["grad_norm"], "count": tf.constant(1)}

    return model.variables + opt.variables, train_step


def test_logs_without_a_loss_key_are_taken_as_they_are():
    """Case 4: main refused them ("step_fn must return a loss, a dict with a 'loss'")."""
    variables, step = two_losses_step()
    out = ms.tf2.fuse(step, STEPS)((X[:STEPS], Y[:STEPS]))
    reference, single = two_losses_step()
    want = single_calls(single, (X, Y), STEPS)
    assert sorted(out) == ["count", "d_loss", "g_loss", "iteration"]
    for key in ("d_loss", "g_loss", "count"):
        np.testing.assert_array_equal(out[key].numpy(), [w[key].numpy() for w in want])
    assert_same_variables(variables, reference)


def test_a_gan_steps_optimizer_slots_are_bitwise():
    """Found under issue 39 (main: the discriminator's Adam slots 1-3 ulp off from step 3):
    the discriminator is called on real and fake, and with the step inlined in the loop
    body the graph optimizer summed its two gradients otherwise than in the single step's
    function. Now the step is a function of its own in the loop: every variable, the
    optimizers' slots included (test_a_step_that_returns_nothing_is_fused_bitwise
    compares the models' weights only)."""
    def optimizers(step):
        return [c.cell_contents for c in step.__closure__
                if isinstance(c.cell_contents, keras.optimizers.Optimizer)]
    images = X[:, :, :4]
    _, reference = gan_step()
    single = tf.function(reference)
    for i in range(STEPS):
        single(images[i])
    _, step = gan_step()
    ms.tf2.fuse(step, STEPS)(images[:STEPS])
    assert_same_variables([v for o in optimizers(step) for v in o.variables],
                          [v for o in optimizers(reference) for v in o.variables])


def test_the_xla_convolution_warning_says_fused_xla_steps_are_not_promised_bitwise():
    """Case 5: main's warning said fused XLA steps are bitwise with single XLA steps (a
    VAE's verify(jit) reported 9.8e-4)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3)])
    opt = keras.optimizers.SGD(0.1)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    with pytest.warns(RuntimeWarning) as caught:
        ms.tf2.fuse(step, 2, jit_compile=True)(tf.ones([2, 1, 4, 4, 1]))
    [message] = [str(w.message) for w in caught if "convolutions" in str(w.message)]
    assert "not promised bitwise" in message and "verify(" in message
    assert "are bitwise with single XLA" not in message


def test_check_on_a_tf_function_step_skips_a_schedules_constant_and_names_the_steps_line():
    """Case 5: main reported the Transformer schedule's d_model as frozen, named '943',
    at the line that called check. A frozen value a tf.function step uses is still found,
    at the line in the step that uses it."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(TransformerSchedule(64), beta_2=0.98, epsilon=1e-9)
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(batch):
        x, y = batch
        with tf.GradientTape() as tape:
            loss = xent(y, model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    assert ms.tf2.check(ms.tf2.fuse(step, STEPS), (X[:STEPS], Y[:STEPS])) == []

    w, sgd = tf.Variable([1.0, -2.0]), keras.optimizers.SGD(0.1)
    with tf.GradientTape() as tape:  # eagerly, before fusing: a constant of the trace
        frozen_grad = tape.gradient(tf.reduce_sum(w * w), w)

    @tf.function
    def frozen(batch):
        sgd.apply_gradients([(frozen_grad * batch, w)])
        return tf.reduce_sum(w)

    [finding] = ms.tf2.check(ms.tf2.fuse(frozen, STEPS), tf.ones([STEPS, 2]))
    line = frozen.python_function.__code__.co_firstlineno + 2  # where the step uses it
    assert finding.kind == "frozen" and f"at {__file__}:{line} (in frozen)" in str(finding)
    assert "captured at" in str(finding)  # (no number for a name)


def test_round_3_bad_arguments_get_a_clear_error_naming_the_argument():
    """Case 6: main: verify(batches=iter(...)) and verify(batches=None) failed inside
    TensorFlow, StepHistory(callbacks=<one callback>) or None with "object is not
    iterable", a string output with a graph UnimplementedError, check="no" was taken."""
    step = lambda batch: tf.reduce_sum(batch)  # noqa: E731
    data = tf.data.Dataset.from_tensor_slices(tf.ones([4, 2]))
    for batches, what in [(iter(data), "OwnedIterator"), (None, "None")]:
        with pytest.raises(TypeError, match=f"verify: batches must be .* got {what}.*Pass the "
                                            f"dataset itself"):
            ms.tf2.verify(step, 2, batches=batches)
    with pytest.raises(TypeError, match=r"callbacks must be a list of keras.callbacks.Callback.*"
                                        r"one callback: callbacks=\[it\]"):
        ms.keras.StepHistory(callbacks=keras.callbacks.History())
    with pytest.raises(TypeError, match="callbacks must be a list.*got None.*leave it out"):
        ms.keras.StepHistory(callbacks=None)
    with pytest.raises(TypeError, match="step_fn's 'loss' must be a number or a scalar tensor.*"
                                        "got a string tensor"):
        ms.tf2.fuse(lambda batch: tf.strings.as_string(batch[0]), 2)(tf.ones([2, 1]))
    with pytest.raises(TypeError, match="check must be True or False.*got 'no'"):
        ms.tf2.fuse(step, 2, check="no")


def test_fuse_takes_a_tf_data_iterators_elements_inside_the_call():
    """Case 7: each element is taken by the fused call itself (one get_next a step, as
    Keras's steps_per_execution), not by N eager get_next calls; bitwise with the custom
    loop's single calls, the last call short (its true length, a warning), then
    exhausted. (What it gains is for benchmarks/tf2_data.py; main passes this test.)"""
    data = tf.data.Dataset.from_tensor_slices((X[:6], Y[:6]))
    model, opt, step = keras_step("batch_norm", "adam")
    fused, iterator = ms.tf2.fuse(step, STEPS), iter(data)
    first = fused(iterator)
    with pytest.warns(RuntimeWarning, match="ran 2 of its 4 steps"):
        second = fused(iterator)
    with pytest.raises(tf.errors.OutOfRangeError):
        fused(iterator)
    assert fused._traces <= 2  # (a first trace that creates variables runs twice)
    reference, _, single = keras_step("batch_norm", "adam")
    want = single_calls(single, (X, Y), 6)
    for key in ("loss", "grad_norm"):
        got = np.concatenate([first[key].numpy(), second[key].numpy()])
        np.testing.assert_array_equal(got, [w[key].numpy() for w in want])
    assert np.concatenate([first["iteration"], second["iteration"]]).tolist() == [1, 2, 3, 4, 5, 6]
    assert_same_variables(model.variables, reference.variables)
