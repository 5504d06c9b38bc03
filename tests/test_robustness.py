"""Nothing lost, nothing silent: non-finite steps, exhausted inputs, checkpoints, long runs."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
STEPS, RUNS = 3, 3
X = np.ones((STEPS * RUNS, 2), np.float32) * np.array([1.0, 0.5], np.float32)
X[4, 0] = np.inf  # global step 5 (run 2, inner step 2) sees an infinite input


def quadratic(x):
    w = V1.get_variable("w", initializer=[1.0, -1.0])
    return tf.reduce_sum(w * w * x)


def build_nonfinite(policy, mode):
    def build(steps):
        xs = V1.placeholder(tf.float32, [steps, 2])
        unrolled = ms.unroll(quadratic, V1.train.AdamOptimizer(0.1), steps, inputs=xs, mode=mode,
                             nonfinite=policy, global_step=V1.train.get_or_create_global_step())
        return unrolled, lambda run: {xs: X[run * steps:(run + 1) * steps]}
    return build


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
@pytest.mark.parametrize("policy", ["skip", "ignore"])
def test_skip_and_ignore_equal_single_steps(policy, mode):
    report = ms.verify(build_nonfinite(policy, mode), steps=STEPS, runs=RUNS)
    assert report.ok and report.bitwise, str(report)
    values = report.final_values
    assert values["global_step"] == STEPS * RUNS  # the global step advances through a skip
    if policy == "skip":
        assert np.isfinite(values["w"]).all() and np.isfinite(values["w/Adam"]).all()
    else:
        assert np.isnan(values["w"]).any()  # applied: the inf reached the weights


def test_a_skipped_step_changes_no_weight_and_no_slot():
    def state_after(feed_rows):
        with tf.Graph().as_default():
            xs = V1.placeholder(tf.float32, [1, 2])
            unrolled = ms.unroll(quadratic, V1.train.AdamOptimizer(0.1), 1, inputs=xs, nonfinite="skip",
                                 global_step=V1.train.get_or_create_global_step())
            with V1.Session() as sess:
                sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
                for row in feed_rows:
                    unrolled.run(sess, {xs: row[None]})
                skipped = {"skipped_steps": sess.run(unrolled.skipped_steps)}
                return {**{v.op.name: sess.run(v) for v in V1.global_variables()}, **skipped}

    before = state_after([X[0]])
    after = state_after([X[0], X[4]])  # the second step is not finite
    for name in before:
        if name in ("global_step", "skipped_steps"):
            assert after[name] == before[name] + 1, name
        else:
            assert after[name].tobytes() == before[name].tobytes(), name


@pytest.mark.parametrize("xla", [False, True])
@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_raise_stops_at_the_step_and_keeps_the_earlier_ones(mode, xla):
    def run(steps, xla=False):
        with tf.Graph().as_default():
            xs = V1.placeholder(tf.float32, [steps, 2])
            gs = V1.train.get_or_create_global_step()
            unrolled = ms.unroll(quadratic, V1.train.AdamOptimizer(0.1), steps, inputs=xs, mode=mode,
                                 global_step=gs, xla=xla)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                error = None
                for r in range(RUNS * STEPS // steps):
                    try:
                        unrolled.run(sess, {xs: X[r * steps:(r + 1) * steps]})
                    except tf.errors.InvalidArgumentError as e:
                        error = e.message
                        break
                state = {v.op.name: sess.run(v) for v in V1.global_variables()}
                # A run after the error starts afresh: finite inputs apply all their steps.
                unrolled.run(sess, {xs: X[:steps]})
                assert sess.run(gs) == state["global_step"] + steps
                return state, error

    fused, message = run(STEPS, xla)
    single, single_message = run(1)
    assert single_message is not None
    assert "non-finite" in message and "not applied" in message
    # unrolled: CheckNumerics quotes the name; XLA's Assert would escape quotes, so none
    assert ("gradient for variable w;" if xla else "gradient for 'w'") in message
    if mode == "unrolled" or xla:
        assert "inner step 2 has a non-finite" in message  # global step 5 is run 2's second step
    assert fused["global_step"] == single["global_step"] == 4  # steps 1-4 applied, step 5 not
    for name in single:
        if xla:  # XLA reorders Adam's arithmetic: four steps of ~20 float32 roundings each
            # (eps 1.2e-7), on values of order 1, with Adam's step bounded by lr = 0.1:
            # |Δ| <= 4 * 20 * 1.2e-7 * 2 < 2e-5 (beta powers: 4 products, far below).
            np.testing.assert_allclose(fused[name], single[name], rtol=0, atol=2e-5, err_msg=name)
        else:
            assert fused[name].tobytes() == single[name].tobytes(), name


def test_bad_nonfinite_policy():
    with tf.Graph().as_default():
        w = tf.Variable(1.0)
        with pytest.raises(ValueError, match="nonfinite must be one of"):
            ms.unroll(lambda: w * w, V1.train.GradientDescentOptimizer(0.1), 2, nonfinite="drop")


def test_skip_refuses_ref_variables():
    with tf.Graph().as_default():
        def loss_fn():
            return tf.reduce_sum(tf.square(V1.get_variable("w", [2], use_resource=False)))

        with pytest.raises(TypeError, match="nonfinite='skip' needs resource variables, but 'w'"):
            ms.unroll(loss_fn, V1.train.GradientDescentOptimizer(0.1), 2, nonfinite="skip")


# An exhausted tf.data input in the middle of a run.

@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_exhausted_input_says_how_many_steps_were_applied(mode):
    with tf.Graph().as_default():
        data = tf.data.Dataset.from_tensor_slices(X[:4].repeat(2, 0)[:5])  # 5 finite batches, runs of 3
        gs = V1.train.get_or_create_global_step()
        unrolled = ms.unroll(quadratic, V1.train.GradientDescentOptimizer(0.1), STEPS, inputs=data,
                             mode=mode, global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            unrolled.run(sess)
            with pytest.raises(ms.InputExhaustedError) as info:
                unrolled.run(sess)
            assert sess.run(gs) == 5
    assert isinstance(info.value, tf.errors.OutOfRangeError)
    assert "the global step is now 5" in info.value.message
    if mode == "unrolled":
        assert "the first 2 of its 3 steps were applied" in info.value.message


# Checkpoints: stopping between fused runs loses nothing.

def mlp_build(steps):
    def loss_fn():
        rng = np.random.RandomState(0)
        x = rng.randn(16, 4).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32)
        w1 = V1.get_variable("w1", initializer=rng.randn(4, 8).astype(np.float32))
        w2 = V1.get_variable("w2", initializer=rng.randn(8, 2).astype(np.float32))
        logits = tf.matmul(tf.tanh(tf.matmul(x, w1)), w2)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    gs = V1.train.get_or_create_global_step()
    return ms.unroll(loss_fn, V1.train.AdamOptimizer(0.05), steps, global_step=gs,
                     grad_transforms=[ms.add_noise(0.01, seed=1)], nonfinite="skip")


def train(steps, runs, *, restore=None, save=None):
    with tf.Graph().as_default():
        unrolled = mlp_build(steps)
        saver = V1.train.Saver()
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            if restore:
                saver.restore(sess, restore)
            for _ in range(runs):
                unrolled.run(sess)
            if save:
                saver.save(sess, save)
            return {v.op.name: sess.run(v) for v in V1.global_variables()}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.asarray(a[name]).tobytes() == np.asarray(b[name]).tobytes(), name


def test_restore_in_a_fresh_process_continues_bitwise(tmp_path):
    uninterrupted = train(3, 4)
    train(3, 2, save=str(tmp_path / "ckpt"))
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_robustness import train
        values = train(3, 2, restore={str(tmp_path / 'ckpt')!r})
        np.savez({str(tmp_path / 'resumed.npz')!r}, **{{k.replace('/', '|'): v for k, v in values.items()}})
    """))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    resumed = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "resumed.npz").items()}
    assert_same(resumed, uninterrupted)
    assert resumed["global_step"] == 12


def test_checkpoints_move_between_single_and_fused_graphs(tmp_path):
    reference = train(1, 12)
    train(1, 6, save=str(tmp_path / "single"))
    assert_same(train(3, 2, restore=str(tmp_path / "single")), reference)
    train(3, 2, save=str(tmp_path / "fused"))
    assert_same(train(1, 6, restore=str(tmp_path / "fused")), reference)


# Load: 10,000 inner steps.

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_ten_thousand_steps_in_loop_mode_match_single_steps_with_flat_memory(capsys):
    from multistep.tools import blobs
    import functools

    build = functools.partial(blobs.build, optimizer="adam", lr=0.01, mode="while_loop")
    memory = []
    report = ms.verify(build, steps=100, runs=100,
                       progress=lambda done, total: memory.append(rss_mib()) if done % 10 == 0 else None)
    assert report.ok and report.bitwise, str(report)
    assert report.final_values["global_step"] == 10_000
    # After the first runs have allocated what they need, resident memory stays flat.
    growth = memory[-1] - memory[1]
    with capsys.disabled():
        print(f"\n10,000 loop-mode steps: RSS at runs 10..100 = {[round(m) for m in memory]} MiB; "
              f"peak {max(memory):.0f} MiB; growth after run 20 {growth:.1f} MiB")
    assert growth < 20, memory


@pytest.mark.parametrize("mode", ["unrolled", "while_loop"])
def test_a_single_step_checkpoint_restores_into_a_skip_graph(tmp_path, mode):
    """A checkpoint written by canonical single steps (minimize) restores into a
    nonfinite="skip" build (its skip counter is a local variable, as steps_per_run: it
    used to be a global one, missing from the checkpoint: NotFoundError); training on
    from it is bitwise with single steps going on; a session that initialised only the
    global variables counts skips from the first one."""
    def single(steps, restore=None, save=None):
        with tf.Graph().as_default():
            x = V1.placeholder(tf.float32, [2])
            gs = V1.train.get_or_create_global_step()
            train = V1.train.AdamOptimizer(0.1).minimize(quadratic(x), global_step=gs)
            saver = V1.train.Saver()
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                if restore:
                    saver.restore(sess, restore)
                for k in steps:
                    sess.run(train, {x: X[k]})
                if save:
                    saver.save(sess, save)
                return {v.op.name: sess.run(v) for v in V1.global_variables()}

    path = str(tmp_path / "single")
    single(range(3), save=path)
    want = single(range(3, 4), restore=path)  # X[3]: finite
    with tf.Graph().as_default():
        xs = V1.placeholder(tf.float32, [2, 2])
        gs = V1.train.get_or_create_global_step()
        unrolled = ms.unroll(quadratic, V1.train.AdamOptimizer(0.1), 2, inputs=xs, mode=mode,
                             nonfinite="skip", global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())  # not the local ones
            V1.train.Saver().restore(sess, path)
            unrolled.run(sess, {xs: X[3:5]})  # X[4] is not finite: skipped
            got = {v.op.name: sess.run(v) for v in V1.global_variables()}
            assert sess.run(unrolled.skipped_steps) == 1
    assert got["global_step"] == want["global_step"] + 1  # the skipped step counts
    for name in want:
        if name != "global_step":
            assert got[name].tobytes() == want[name].tobytes(), name
