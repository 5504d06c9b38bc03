"""ms.hooks and the run length of loop mode, against independent references.

The reference for every hook is the same model trained one step per sess.run
inside a MonitoredTrainingSession with TensorFlow's own hooks: the final global
step, every checkpoint (weights, Adam slots, global step) and the summaries
written must be the same, bitwise. A fused run's steps are the single steps'
operations in the same order, so there is no tolerance to state.
"""

import glob
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import multistep as ms

# one xdist worker runs this file: its module-scoped fixtures are built once
pytestmark = pytest.mark.xdist_group("test_hooks")

V1 = tf.compat.v1
B, D, H, C, BATCHES = 8, 3, 5, 2, 40
rng = np.random.RandomState(0)
X = rng.randn(BATCHES, B, D).astype(np.float32)
Y = rng.randint(0, C, size=(BATCHES, B)).astype(np.int32)
W1 = (rng.randn(D, H) * 0.5).astype(np.float32)
W2 = (rng.randn(H, C) * 0.5).astype(np.float32)
TAGS = ("loss", "grad_norm")


@pytest.fixture(autouse=True)
def close_summary_writers():
    """MonitoredTrainingSession's hooks open cached FileWriters, each with a thread."""
    yield
    V1.summary.FileWriterCache.clear()


def loss_fn(x, y):
    w1 = V1.get_variable("hidden/kernel", initializer=W1)
    b1 = V1.get_variable("hidden/bias", initializer=np.zeros(H, np.float32))
    w2 = V1.get_variable("out/kernel", initializer=W2)
    b2 = V1.get_variable("out/bias", initializer=np.zeros(C, np.float32))
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def dataset(start=0, stop=BATCHES, x=X):
    return tf.data.Dataset.from_tensor_slices((x[start:stop], Y[start:stop]))


def single_step_graph(data, model=loss_fn, optimizer=None):
    """The canonical TF1 step: (train_op, loss); summaries of loss and gradient norm."""
    gs = V1.train.get_or_create_global_step()
    x, y = V1.data.make_one_shot_iterator(data).get_next()
    loss = model(x, y)
    opt = optimizer or V1.train.AdamOptimizer(0.05)
    grads = opt.compute_gradients(loss)
    train = opt.apply_gradients(grads, global_step=gs)
    V1.summary.scalar("loss", loss)
    V1.summary.scalar("grad_norm", tf.linalg.global_norm([g for g, _ in grads]))
    keep_every_checkpoint()
    return train, loss


def fused_graph(data, steps, mode="while_loop", model=loss_fn, optimizer=None, **options):
    unrolled = ms.unroll(model, optimizer or V1.train.AdamOptimizer(0.05), steps, inputs=data,
                         mode=mode, global_step=V1.train.get_or_create_global_step(),
                         record=("grad_norm",), **options)
    keep_every_checkpoint()
    return unrolled


def keep_every_checkpoint():
    """The graph's saver (MonitoredTrainingSession and CheckpointSaverHook use the one in
    SAVERS), keeping every checkpoint instead of the last 5."""
    V1.add_to_collection(V1.GraphKeys.SAVERS, V1.train.Saver(max_to_keep=None))


def train(hooks, fetch, *, checkpoint_dir=None, runs=None, config=None):
    """MonitoredTrainingSession with only ``hooks``; runs ``fetch`` until stopped (or
    ``runs`` times); returns the number of runs."""
    done = 0
    with V1.train.MonitoredTrainingSession(
            checkpoint_dir=checkpoint_dir, hooks=hooks,
            save_checkpoint_secs=None, save_checkpoint_steps=None, save_summaries_steps=None,
            save_summaries_secs=None, log_step_count_steps=None, config=config) as sess:
        while not sess.should_stop() and (runs is None or done < runs):
            sess.run(fetch)
            done += 1
    return done


def checkpoints(directory):
    """global step -> {variable name: value} of every checkpoint in ``directory``."""
    out = {}
    for index in glob.glob(os.path.join(directory, "model.ckpt-*.index")):
        step = int(re.search(r"model\.ckpt-(\d+)\.index$", index).group(1))
        reader = tf.train.load_checkpoint(index[:-len(".index")])
        out[step] = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    return out


def summaries(directory, tags=TAGS):
    """(tag, global step, value) of every scalar with a tag in ``tags``, in file order."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in V1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag in tags:
                    out.append((value.tag, event.step, value.simple_value))
    return out


def every(n, triples):
    """The summaries written at steps 1, 1 + n, 1 + 2n, ...: what SummarySaverHook(save_steps=n)
    means, and what StepSummaryHook(every_n_steps=n) writes. (The reference writes every
    step: SummarySaverHook with save_steps > 1 predicts the next step from a global step
    read that races with the apply, so which steps it writes varies from run to run.)"""
    return [t for t in triples if (t[1] - 1) % n == 0]


def assert_same_checkpoint(a, b):
    assert sorted(a) == sorted(b)
    differ = [name for name in a if a[name].tobytes() != b[name].tobytes()]
    assert not differ, f"not bitwise equal: {differ}"


def single_steps(tmp_path, last_step, *, save_steps, data=dataset):
    """TensorFlow's own hooks on single steps: (checkpoints, summaries of every step, runs)."""
    directory = str(tmp_path / "single")
    with tf.Graph().as_default():
        train_op, _ = single_step_graph(data())
        hooks = [V1.train.StopAtStepHook(last_step=last_step),
                 V1.train.CheckpointSaverHook(directory, save_steps=save_steps, scaffold=None),
                 V1.train.SummarySaverHook(save_steps=1, output_dir=directory,
                                           summary_op=V1.summary.merge_all())]
        runs = train(hooks, train_op, checkpoint_dir=directory)
    return checkpoints(directory), summaries(directory), runs


def fused_steps(tmp_path, steps, last_step, *, save_steps, summary_steps=1, mode="while_loop",
                name="fused", data=dataset, extra=()):
    directory = str(tmp_path / name)
    with tf.Graph().as_default():
        unrolled = fused_graph(data(), steps, mode)
        hooks = [ms.hooks.StopAtStepHook(unrolled, last_step),
                 ms.hooks.steps_per_run_aware(
                     V1.train.CheckpointSaverHook(directory, save_steps=save_steps), unrolled),
                 ms.hooks.StepSummaryHook(unrolled, directory, every_n_steps=summary_steps),
                 *[make(unrolled) for make in extra]]
        runs = train(hooks, unrolled.train_op, checkpoint_dir=directory)
    return checkpoints(directory), summaries(directory), runs


# Loop mode's run length.

def plain_single_steps(total):
    """Variables after each of ``total`` single steps, and every step's loss."""
    with tf.Graph().as_default():
        train_op, loss = single_step_graph(dataset())
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            after, losses = [], []
            for _ in range(total):
                losses.append(sess.run([train_op, loss])[1])
                after.append(sess.run({v.op.name: v for v in V1.global_variables()}))
    return after, np.array(losses, np.float32)


def test_set_steps_per_run_between_runs_is_bitwise_the_same_single_steps():
    lengths = (7, 1, 3, 7)
    after, single_losses = plain_single_steps(sum(lengths))
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 7)
        init = [V1.global_variables_initializer(), V1.local_variables_initializer()]
        variables = {v.op.name: v for v in V1.global_variables()}
        V1.get_default_graph().finalize()  # set_steps_per_run may not make an op
        with V1.Session() as sess:
            sess.run(init)
            done, losses = 0, []
            for n in lengths:
                unrolled.set_steps_per_run(sess, n)
                run_losses, records = sess.run([unrolled.losses, unrolled.records])
                assert run_losses.shape == records["grad_norm"].shape == (n,)
                done += n
                losses.extend(run_losses)
                state = sess.run(variables)
                assert state["global_step"] == done
                assert_same_checkpoint(state, after[done - 1])
    assert np.array(losses, np.float32).tobytes() == single_losses.tobytes()


def test_steps_per_run_is_in_no_collection_and_survives_a_local_variables_reset():
    """steps_per_run is neither saved (no global variable) nor reset by the per-epoch
    ``local_variables_initializer()`` of a metric reset (it was a local variable: the
    reset set the run length back to N). Uninitialised, the loop makes ``steps`` steps."""
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 5)
        assert unrolled.steps_per_run not in V1.local_variables()
        assert unrolled.steps_per_run not in V1.global_variables()
        assert unrolled.steps_per_run.dtype == tf.int32
        saved = V1.train.Saver()._var_list  # what a default Saver writes
        assert all("steps_per_run" not in getattr(v, "name", str(v)) for v in saved)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            assert len(unrolled.run(sess)) == 5  # uninitialised: `steps` steps
            unrolled.set_steps_per_run(sess, 2)
            sess.run(V1.local_variables_initializer())  # a metric reset between epochs
            assert len(unrolled.run(sess)) == 2
            assert sess.run(unrolled.steps_per_run) == 2


def test_set_steps_per_run_refuses_what_it_cannot_do():
    with tf.Graph().as_default():
        loop = fused_graph(dataset(), 4)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            for bad in (0, 5, -1):
                with pytest.raises(ValueError, match=r"steps per run must be in 1\.\.4 .*got"):
                    loop.set_steps_per_run(sess, bad)
            for bad in (2.0, "3", True, None):
                with pytest.raises(TypeError, match="steps per run must be an int"):
                    loop.set_steps_per_run(sess, bad)
            loop.set_steps_per_run(sess, np.int64(2))
            assert sess.run(loop.steps_per_run) == 2
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4, mode="unrolled")
        assert unrolled.steps_per_run is None
        with pytest.raises(TypeError, match="set_steps_per_run needs mode='while_loop'"):
            unrolled.set_steps_per_run(None, 2)


def test_xla_loop_takes_the_run_length_at_run_time():
    with tf.Graph().as_default():
        x = V1.placeholder(tf.float32, [None, B, D])  # a run takes one batch per step it does
        y = V1.placeholder(tf.int32, [None, B])
        gs = V1.train.get_or_create_global_step()
        unrolled = ms.unroll(loss_fn, V1.train.AdamOptimizer(0.05), 7, inputs=(x, y),
                             mode="while_loop", xla=True, global_step=gs)
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            total = 0
            for n in (7, 1, 3):
                unrolled.set_steps_per_run(sess, n)
                assert unrolled.run(sess, {x: X[:n], y: Y[:n]}).shape == (n,)
                total += n
                assert sess.run(gs) == total


def test_loop_mode_exhausted_input_says_exactly_how_many_steps_were_applied():
    """... and the error holds the losses of the 2 steps applied (steps 8 and 9), bitwise
    with the canonical single steps'."""
    with tf.Graph().as_default():
        train_op, loss = single_step_graph(dataset(0, 9))
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            want = [sess.run([loss, train_op])[0] for _ in range(9)]
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(0, 9), 4)  # 9 batches: runs of 4, then 3 and 3
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(), V1.local_variables_initializer()])
            unrolled.run(sess)
            unrolled.set_steps_per_run(sess, 3)
            unrolled.run(sess)
            with pytest.raises(ms.InputExhaustedError) as info:
                unrolled.run(sess)
            assert sess.run(unrolled.global_step) == 9
    assert ("the input ran out during a run: the first 2 of its 3 steps were applied; "
            "the global step is now 9" in info.value.message)
    assert info.value.values.tobytes() == np.array(want[7:], np.float32).tobytes()


# MonitoredTrainingSession: ms.hooks against TensorFlow's hooks on single steps.

@pytest.mark.parametrize("steps, last_step, mode", [
    (4, 22, "while_loop"),   # last_step not a multiple of N: the last run is shortened to 2
    (5, 22, "while_loop"),
    (4, 20, "unrolled"),     # unrolled mode: last_step reachable by whole runs
])
def test_stop_checkpoints_and_summaries_match_single_steps(tmp_path, steps, last_step, mode):
    single, single_summaries, single_runs = single_steps(tmp_path, last_step, save_steps=steps * 2)
    fused, fused_summaries, runs = fused_steps(tmp_path, steps, last_step, save_steps=steps * 2,
                                               summary_steps=3, mode=mode)
    assert single_runs == last_step and runs == -(-last_step // steps)
    # checkpoints at the same global steps (0, every 2N, the last step), bitwise the same
    assert sorted(fused) == sorted(single)
    assert max(fused) == last_step
    for step in single:
        assert fused[step]["global_step"] == step
        assert_same_checkpoint(fused[step], single[step])
    # the same (tag, step, value) triples, for loss and gradient norm, every 3 steps from step 1
    assert [s for tag, s, _ in single_summaries if tag == "loss"] == list(range(1, last_step + 1))
    assert sorted(fused_summaries) == sorted(every(3, single_summaries))


def test_a_checkpoint_interval_that_is_not_a_multiple_of_the_run_length(tmp_path):
    """save_steps=6, runs of 4: a checkpoint at the end of the first run whose global step is
    at least 6 past the last checkpoint's: 0, 8, 16, and the last step 22 (as documented in
    steps_per_run_aware); each bitwise the state single steps reach at that global step."""
    single, _, _ = single_steps(tmp_path, 22, save_steps=1)  # a checkpoint at every step
    fused, _, _ = fused_steps(tmp_path, 4, 22, save_steps=6)
    assert sorted(fused) == [0, 8, 16, 22]
    for step in fused:
        assert_same_checkpoint(fused[step], single[step])


def test_step_counter_told_the_run_length_is_not_a_run_late(tmp_path):
    """Told nothing, StepCounterHook adds 1 to a global step read that races with the run's
    steps and may look a run too early; told the run length it looks at the true step."""
    directory = str(tmp_path / "counter")
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4)
        counter = V1.train.StepCounterHook(every_n_steps=8, output_dir=directory)
        train([ms.hooks.StopAtStepHook(unrolled, 30),
               ms.hooks.steps_per_run_aware(counter, unrolled)], unrolled.train_op)
    V1.summary.FileWriterCache.clear()
    # the first run (step 4) starts its timer; then the end of each run 8 or more steps later
    assert [step for _, step, _ in summaries(directory, tags=("global_step/sec",))] == [12, 20, 28]


def test_steps_per_run_aware_refuses_hooks_that_count_runs():
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4)
        loss = unrolled.losses
        for hook, instead in [(V1.train.SummarySaverHook(save_steps=1, output_dir="/tmp/x",
                                                         summary_op=tf.constant("")),
                               "ms.hooks.StepSummaryHook"),
                              (V1.train.NanTensorHook(loss), "ms.hooks.NanHook"),
                              (V1.train.LoggingTensorHook([loss], every_n_iter=1),
                               "ms.hooks.LoggingHook")]:
            with pytest.raises(TypeError, match=f"no _set_steps_per_run.*use {instead} instead"):
                ms.hooks.steps_per_run_aware(hook, unrolled)


def test_stop_in_unrolled_mode_refuses_a_last_step_it_cannot_reach(tmp_path):
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4, mode="unrolled")
        with pytest.raises(ValueError, match=r"cannot stop at last_step=22: 6 runs would end "
                                             r"at 24\. Build it with mode='while_loop'"):
            train([ms.hooks.StopAtStepHook(unrolled, 22)], unrolled.train_op)


def test_resuming_from_a_checkpoint_continues_bitwise(tmp_path):
    """Stop at 10, resume to 22 (the input skips what was used): the same checkpoint at 22
    as single steps straight to 22."""
    single, _, _ = single_steps(tmp_path, 22, save_steps=100)
    directory = str(tmp_path / "resumed")
    for start, last_step in ((0, 10), (10, 22)):
        with tf.Graph().as_default():
            unrolled = fused_graph(dataset(start), 4)
            hooks = [ms.hooks.StopAtStepHook(unrolled, last_step), ms.hooks.steps_per_run_aware(
                V1.train.CheckpointSaverHook(directory, save_steps=100), unrolled)]
            runs = train(hooks, unrolled.train_op, checkpoint_dir=directory)
            assert runs == {10: 3, 22: 3}[last_step]  # 4+4+2, then 4+4+4
    resumed = checkpoints(directory)
    assert sorted(resumed) == [0, 10, 22]
    assert_same_checkpoint(resumed[22], single[22])
    # resumed at last_step: stops before its first run (TensorFlow's hook would run one)
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(22), 4)
        assert train([ms.hooks.StopAtStepHook(unrolled, 22)], unrolled.train_op,
                     checkpoint_dir=directory) == 0


class PreemptOnce(V1.train.SessionRunHook):
    """Raises AbortedError after the first run that reaches global step ``at``: the
    MonitoredSession closes its session, creates a new one restored from the last checkpoint,
    and calls every hook's after_create_session again."""

    def __init__(self, at):
        self.at, self.done = at, False

    def begin(self):
        self.global_step = V1.train.get_global_step()

    def after_run(self, run_context, run_values):
        if not self.done and run_context.session.run(self.global_step) >= self.at:
            self.done = True
            raise tf.errors.AbortedError(None, None, "preempted (test)")


def test_stop_at_step_num_steps_counts_from_the_first_sessions_global_step(tmp_path):
    """Train to 10; resume with num_steps=12: stop at 22, as TensorFlow's
    StopAtStepHook(num_steps=12) on single steps. A preemption at 18 re-creates the session
    from the checkpoint at 18: TensorFlow's hook keeps the last step it read at the first
    session (22, not 18 + 12). Every checkpoint, bitwise the single steps'."""
    def two_stages(name, fused):
        directory = str(tmp_path / name)
        for start, save_steps in ((0, 100), (10, 4)):
            with tf.Graph().as_default():
                if fused:
                    unrolled = fused_graph(dataset(start), 4)
                    fetch = unrolled.train_op
                    stop = (ms.hooks.StopAtStepHook(unrolled, 10) if start == 0 else
                            ms.hooks.StopAtStepHook(unrolled, num_steps=12))
                    saver = ms.hooks.steps_per_run_aware(
                        V1.train.CheckpointSaverHook(directory, save_steps=save_steps), unrolled)
                else:
                    fetch, _ = single_step_graph(dataset(start))
                    stop = (V1.train.StopAtStepHook(last_step=10) if start == 0 else
                            V1.train.StopAtStepHook(num_steps=12))
                    saver = V1.train.CheckpointSaverHook(directory, save_steps=save_steps)
                train([stop, saver, PreemptOnce(18)], fetch, checkpoint_dir=directory)
        return checkpoints(directory)

    single, fused = two_stages("single", False), two_stages("fused", True)
    assert sorted(single) == sorted(fused) == [0, 10, 14, 18, 22]
    for step in single:
        assert_same_checkpoint(fused[step], single[step])


def test_stop_at_step_takes_exactly_one_of_num_steps_and_last_step():
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4)
        with pytest.raises(ValueError, match="One of num_steps or last_step must be specified"):
            ms.hooks.StopAtStepHook(unrolled)
        with pytest.raises(ValueError, match="Only one of num_steps or last_step can be specified"):
            ms.hooks.StopAtStepHook(unrolled, 10, num_steps=5)
        for bad in (-1, 2.5, True):
            with pytest.raises(ValueError, match="num_steps must be an int >= 0"):
                ms.hooks.StopAtStepHook(unrolled, num_steps=bad)


class GlobalStepAtEnd(V1.train.SessionRunHook):
    """Listed after the hook under test: the global step once its end() has run."""

    def begin(self):
        self.global_step, self.value = V1.train.get_global_step(), None

    def end(self, session):
        self.value = session.run(self.global_step)


def test_final_ops_hook_gives_the_last_runs_values_and_trains_no_step(tmp_path):
    """TensorFlow's FinalOpsHook({"loss": unrolled.losses}) fetches the losses at end(), which
    runs N more steps (stopped at 22, it left the global step at 26). ms.hooks.FinalOpsHook
    gives the values the last run returned: that run was shortened to steps 21 and 22, whose
    loss and gradient norm single steps wrote (SummarySaverHook); nothing trains at end(): the
    checkpoint written after it is single steps' at 22, bitwise."""
    single, single_summaries, _ = single_steps(tmp_path, 22, save_steps=100)
    directory = str(tmp_path / "fused")
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4)
        final = ms.hooks.FinalOpsHook(unrolled, {
            "loss": unrolled.losses, "grad_norm": unrolled.records["grad_norm"],
            "step": unrolled.global_step})
        trains = tf.identity(unrolled.losses)
        with pytest.raises(ValueError, match=rf"fetching {re.escape(trains.name)} at end\(\) "
                                             r"would run multistep's steps again"):
            ms.hooks.FinalOpsHook(unrolled, [unrolled.global_step, trains])
        at_end = GlobalStepAtEnd()
        saver = ms.hooks.steps_per_run_aware(
            V1.train.CheckpointSaverHook(directory, save_steps=100), unrolled)
        train([ms.hooks.StopAtStepHook(unrolled, 22), final, at_end, saver], unrolled.train_op,
              checkpoint_dir=directory)
    values = final.final_ops_values
    assert values["step"] == at_end.value == 22
    for tag in ("loss", "grad_norm"):
        want = np.float32([v for t, step, v in single_summaries if t == tag and step in (21, 22)])
        assert values[tag].tobytes() == want.tobytes(), (tag, values[tag], want)
    assert sorted(checkpoints(directory)) == [0, 22]
    assert_same_checkpoint(checkpoints(directory)[22], single[22])


def loss_scale_optimizer():
    """Adam under a dynamic loss scale starting at 2**113: with the loss scaled by 2**20
    (``big_loss``), the scaled gradients overflow float32 until the scale has halved 6
    times, and each of those steps skips its apply and its increment of the global step."""
    return V1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        V1.train.AdamOptimizer(0.05),
        loss_scale=V1.mixed_precision.DynamicLossScale(initial_loss_scale=2.0 ** 113))


def big_loss(x, y):
    return loss_fn(x, y) * 2.0 ** 20


def test_step_summaries_are_at_the_true_global_step_when_the_optimizer_skips_increments(tmp_path):
    """Single steps with TensorFlow's SummarySaverHook(save_steps=1) write each step's loss at
    the global step after it: 0 for the 6 skipped steps, then 1..10. Runs of 4 (16 steps to
    reach 10): run 1 advanced the global step by none (steps 1-4: all at 0; every_n_steps=1
    writes one point a global step, the first), run 2 by 2 of 4 (only its last step's is
    known: step 8, at 2), runs 3 and 4 by 4 (steps 9-16 at 3..10). Before, the points were
    placed back from the run's end: at global steps -3..10."""
    directory = str(tmp_path / "single")
    with tf.Graph().as_default():
        train_op, _ = single_step_graph(dataset(), big_loss, loss_scale_optimizer())
        train([V1.train.StopAtStepHook(last_step=10),
               V1.train.SummarySaverHook(save_steps=1, output_dir=directory,
                                         summary_op=V1.summary.merge_all())], train_op)
    reference = summaries(directory, ("loss",))
    assert [step for _, step, _ in reference] == [0] * 6 + list(range(1, 11))
    directory = str(tmp_path / "fused")
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4, model=big_loss, optimizer=loss_scale_optimizer(),
                               nonfinite="ignore")  # the optimizer skips the overflowing steps
        assert train([ms.hooks.StopAtStepHook(unrolled, 10),
                      ms.hooks.StepSummaryHook(unrolled, directory)], unrolled.train_op) == 4
    V1.summary.FileWriterCache.clear()
    assert summaries(directory, ("loss",)) == [reference[k - 1] for k in (1, *range(8, 17))]


def test_runs_that_do_not_train_run_no_step(tmp_path):
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4)
        gs = unrolled.global_step
        other = tf.group(unrolled.train_op, name="user_group")  # trains, through a group
        hooks = [ms.hooks.StopAtStepHook(unrolled, 100), ms.hooks.NanHook(unrolled),
                 ms.hooks.LoggingHook(unrolled, 1), ms.hooks.InputExhaustedHook(unrolled),
                 ms.hooks.StepSummaryHook(unrolled, str(tmp_path)),
                 ms.hooks.steps_per_run_aware(V1.train.StepCounterHook(output_dir=str(tmp_path)),
                                              unrolled)]
        with V1.train.MonitoredTrainingSession(hooks=hooks, log_step_count_steps=None,
                                               save_summaries_steps=None) as sess:
            assert [sess.run(gs) for _ in range(3)] == [0, 0, 0]
            sess.run(unrolled.train_op.name)  # by name
            assert sess.run(gs) == 4
            sess.run([other])
            assert sess.run({"step": gs}) == {"step": 8}
    assert [s for _, s, _ in summaries(str(tmp_path), ("loss",))] == list(range(1, 9))


def test_logging_hook_logs_the_values_loggingtensorhook_logs_for_single_steps():
    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    def logged(build):
        logger, handler = tf.get_logger(), Lines()
        level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        try:
            with tf.Graph().as_default():
                train_op, hooks = build()
                train(hooks, train_op)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        return handler.lines

    def single():
        train_op, loss = single_step_graph(dataset())
        return train_op, [V1.train.StopAtStepHook(last_step=22),
                          V1.train.LoggingTensorHook({"loss": loss}, every_n_iter=5)]

    def fused():
        unrolled = fused_graph(dataset(), 4)
        return unrolled.train_op, [ms.hooks.StopAtStepHook(unrolled, 22),
                                   ms.hooks.LoggingHook(unrolled, 5)]

    reference = [float(re.match(r"loss = (\S+)", line).group(1))
                 for line in logged(single) if line.startswith("loss = ")]
    lines = [line for line in logged(fused) if ": global step " in line]
    steps = [int(re.search(r"global step (\d+):", line).group(1)) for line in lines]
    values = [float(re.search(r"loss = (\S+?),", line).group(1)) for line in lines]
    assert steps == [1, 6, 11, 16, 21]  # LoggingTensorHook's iterations 0, 5, 10, ...
    assert len(reference) == 5 and values == reference
    assert all("grad_norm = " in line for line in lines)


def nan_passing_loss(x, y):
    """loss_fn, with a NaN input making the loss NaN (ReLU would turn it into 0)."""
    return loss_fn(x, y) + 0.0 * tf.reduce_sum(x)


def test_nan_hook_names_the_step_where_single_steps_see_the_nan(tmp_path):
    poisoned = X.copy()
    poisoned[5, 0, 0] = np.nan  # global step 6, inner step 2 of the second run of 4

    # single steps with TensorFlow's NanTensorHook: fails in the run that makes step 6
    with tf.Graph().as_default():
        train_op, loss = single_step_graph(dataset(x=poisoned), nan_passing_loss)
        runs = []
        with pytest.raises(V1.train.NanLossDuringTrainingError):
            train([ms_counter(runs), V1.train.NanTensorHook(loss)], train_op)
        assert len(runs) == 6
    # Whether the NaN reaches the weights (and so the later losses) depends on the CPU's
    # kernels (Relu of NaN is 0 on some, NaN on others): the count comes from single steps.
    with tf.Graph().as_default():
        train_op, loss = single_step_graph(dataset(x=poisoned), nan_passing_loss)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            losses = [sess.run([train_op, loss])[1] for _ in range(8)]
    bad = int(np.sum(~np.isfinite(losses[4:])))
    assert np.isnan(losses[5]) and np.all(np.isfinite(losses[:5]))
    for fail in (True, False):
        with tf.Graph().as_default():
            unrolled = fused_graph(dataset(x=poisoned), 4, model=nan_passing_loss,
                                   nonfinite="ignore")
            hook = ms.hooks.NanHook(unrolled, fail_on_nan_loss=fail)
            if fail:
                with pytest.raises(ms.hooks.NonFiniteLossError,
                                   match=r"loss = nan at inner step 2 of 4 \(global step 6\); "
                                         rf"{bad} of the run's 4 losses are not finite"):
                    train([hook], unrolled.train_op)
            else:
                assert train([hook], unrolled.train_op) == 2  # stopped after that run


def ms_counter(runs):
    class Counter(V1.train.SessionRunHook):
        def after_run(self, run_context, run_values):
            runs.append(1)
    return Counter()


def test_input_running_out_mid_run_ends_training_cleanly_and_says_where(tmp_path):
    """22 batches, runs of 4: five runs, then 2 of the sixth's steps; single steps end at 22
    with the same weights."""
    single, _, _ = single_steps(tmp_path, 1000, save_steps=1000,
                                data=lambda: dataset(0, 22))
    for mode in ("while_loop", "unrolled"):
        directory = str(tmp_path / mode)
        with tf.Graph().as_default():
            unrolled = fused_graph(dataset(0, 22), 4, mode)
            exhausted = ms.hooks.InputExhaustedHook(unrolled)
            saver = ms.hooks.steps_per_run_aware(
                V1.train.CheckpointSaverHook(directory, save_steps=1000), unrolled)
            assert train([exhausted, saver], unrolled.train_op, checkpoint_dir=directory) == 5
        assert exhausted.steps_applied == 2
        assert exhausted.message == ("multistep: the input ran out during a run: the first 2 of "
                                     "its 4 steps were applied; the global step is now 22.")
        assert_same_checkpoint(checkpoints(directory)[22], single[22])


def test_auto_steps_converges_under_a_noisy_fake_clock_and_never_exceeds_steps():
    """A run of n steps takes (a + b n)(1 + noise) fake seconds, noise uniform in +-10%:
    the ideal length for 0.5 s is (0.5 - a) / b = 48; the hook settles within 25% of it
    (its hysteresis band), then stays there."""
    a, b = 0.02, 0.01

    def lengths(steps, max_steps=None, runs=40):
        clock = {"now": 0.0}
        noise = np.random.RandomState(1).uniform(-0.1, 0.1, size=runs)
        seen = []

        class Clock(V1.train.SessionRunHook):  # listed first: its after_run runs before Auto's
            def __init__(self, unrolled):
                self.unrolled = unrolled

            def before_run(self, run_context):
                return V1.train.SessionRunArgs(self.unrolled.losses)

            def after_run(self, run_context, run_values):
                n = len(run_values.results)
                seen.append(n)
                clock["now"] += (a + b * n) * (1 + noise[len(seen) - 1])

        with tf.Graph().as_default():
            unrolled = fused_graph(dataset().repeat(), steps)
            auto = ms.hooks.AutoStepsHook(unrolled, target_seconds=0.5, max_steps=max_steps,
                                          timer=lambda: clock["now"])
            train([Clock(unrolled), auto], unrolled.train_op, runs=runs)
        return seen

    seen = lengths(64)
    assert seen[0] == 1 and max(seen) <= 64
    assert 48 / 1.25 <= seen[-1] <= 48 * 1.25
    assert len(set(seen[-20:])) == 1  # settled: no change in the last 20 runs
    capped = lengths(30)
    assert max(capped) == 30 and capped[-1] == 30
    assert max(lengths(64, max_steps=20)) == 20


def test_monitored_training_session_wires_the_hooks_like_single_steps(tmp_path):
    """The helper, with AutoStepsHook choosing run lengths from a real clock (whatever they
    are, the result may not change) and the last run shortened: TensorFlow's single steps."""
    single, single_summaries, _ = single_steps(tmp_path, 22, save_steps=8)
    directory = str(tmp_path / "helper")
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 8)
        with ms.hooks.monitored_training_session(
                unrolled, last_step=22, checkpoint_dir=directory, save_checkpoint_steps=8,
                save_summaries_steps=3, log_step_count_steps=None,
                target_seconds=1e-3) as sess:
            lengths = []
            while not sess.should_stop():
                lengths.append(len(sess.run(unrolled.losses)))
    assert sum(lengths) == 22 and max(lengths) <= 8
    fused = checkpoints(directory)
    assert 22 in fused and 0 in fused
    for step in fused:
        assert_same_checkpoint(fused[step], single_steps_state(single, step, tmp_path))
    assert sorted(summaries(directory)) == sorted(every(3, single_summaries))


def single_steps_state(single, step, tmp_path):
    """The single-step state at ``step``: from ``single`` if it has it, else a reference run
    with a checkpoint at every step (run lengths chosen by a clock end anywhere)."""
    if step not in single:
        every = tmp_path / "every_step"
        if not every.exists():
            every.mkdir()
            single_steps(every, 22, save_steps=1)
        single = checkpoints(str(every / "single"))
    return single[step]


def test_hooks_refuse_bad_arguments():
    with tf.Graph().as_default():
        unrolled = fused_graph(dataset(), 4, mode="unrolled", name="unrolled")
    with tf.Graph().as_default():
        loop = fused_graph(dataset(), 4)
        w = tf.Variable(1.0)
        no_step = ms.unroll(lambda: w * w, V1.train.GradientDescentOptimizer(0.1), 2,
                            mode="while_loop", name="no_step")
        for make in (lambda: ms.hooks.StopAtStepHook(no_step, 10),
                     lambda: ms.hooks.StepSummaryHook(no_step, "/tmp/x"),
                     lambda: ms.hooks.LoggingHook(no_step, 1),
                     lambda: ms.hooks.InputExhaustedHook(no_step)):
            with pytest.raises(ValueError, match=r"needs the global step .*global_step="):
                make()
        ms.hooks.NanHook(no_step)  # places steps by their index in the run: no global step needed
        with pytest.raises(TypeError, match="AutoStepsHook: unrolled was built in mode='unrolled'"):
            ms.hooks.AutoStepsHook(unrolled)
        with pytest.raises(TypeError, match="takes the Unrolled that ms.unroll returned"):
            ms.hooks.StopAtStepHook(loop.train_op, 10)
        for bad in (-1, 2.5, True):
            with pytest.raises(ValueError, match="last_step must be an int >= 0"):
                ms.hooks.StopAtStepHook(loop, bad)
        for bad in (0, 1.5):
            with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
                ms.hooks.LoggingHook(loop, bad)
        with pytest.raises(ValueError, match="target_seconds must be > 0"):
            ms.hooks.AutoStepsHook(loop, target_seconds=0)
        with pytest.raises(ValueError, match="max_steps must be an int >= 1 or None"):
            ms.hooks.AutoStepsHook(loop, max_steps=0)


# Under ms.distribute.unroll: MirroredStrategy over two logical CPUs, which must be configured
# before a process's first session, so in a subprocess (as tests/test_distribute.py).

DISTRIBUTED = r'''
import json
import glob
import os
import sys

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.compat.v1.disable_eager_execution()
tf.get_logger().setLevel("ERROR")
import multistep as ms  # noqa: E402

V1 = tf.compat.v1
GLOBAL_BATCH, STEPS, LAST_STEP = 8, 4, 12
rng = np.random.RandomState(0)
X = rng.randn(20 * GLOBAL_BATCH, 3).astype(np.float32)
Y = rng.randn(20 * GLOBAL_BATCH, 2).astype(np.float32)
W0 = rng.randn(3, 2).astype(np.float32)


class End(V1.train.SessionRunHook):
    """Listed last: every copy of every variable once the other hooks' end() has run."""

    def __init__(self, strategy):
        self.strategy = strategy

    def end(self, session):
        self.state = {f"{v.op.name}@{i}": session.run(local).tobytes().hex()
                      for v in V1.global_variables()
                      for i, local in enumerate(self.strategy.experimental_local_results(v))}


def train(fused, directory):
    with tf.Graph().as_default():
        strategy = V1.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            w = V1.get_variable("w", initializer=W0, use_resource=True)
            b = V1.get_variable("b", initializer=np.zeros(2, np.float32), use_resource=True)
            gs = V1.train.get_or_create_global_step()

        def loss_fn(x, y):  # one replica's half batch, over the global batch: summed, the whole
            return tf.reduce_sum(tf.square(tf.matmul(x, w) + b - y)) / GLOBAL_BATCH

        opt = V1.train.AdamOptimizer(0.1)
        iterator = strategy.make_dataset_iterator(
            tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH))
        if fused:
            u = ms.distribute.unroll(strategy, loss_fn, opt, STEPS, inputs=iterator, global_step=gs)
            final = ms.hooks.FinalOpsHook(u, {"loss": u.losses, "step": gs})
            hooks = [ms.hooks.StopAtStepHook(u, LAST_STEP), ms.hooks.StepSummaryHook(u, directory),
                     final]
            run = u.run
        else:
            def step(x, y):  # the canonical single distributed step
                loss = loss_fn(x, y)
                with tf.control_dependencies(V1.get_collection(V1.GraphKeys.UPDATE_OPS)):
                    train_op = opt.minimize(loss, global_step=gs)
                with tf.control_dependencies([train_op]):
                    return tf.identity(loss)

            with strategy.scope():
                per_replica = strategy.extended.call_for_each_replica(
                    step, args=iterator.get_next())
                loss = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)
            V1.summary.scalar("loss", loss)
            final = V1.train.FinalOpsHook({"step": gs})
            hooks = [V1.train.StopAtStepHook(last_step=LAST_STEP),
                     V1.train.SummarySaverHook(save_steps=1, output_dir=directory,
                                               summary_op=V1.summary.merge_all()), final]
            run = lambda sess: sess.run(loss)  # noqa: E731
        end = End(strategy)
        scaffold = V1.train.Scaffold(local_init_op=tf.group(V1.local_variables_initializer(),
                                                            iterator.initializer))
        runs = 0
        with V1.train.MonitoredTrainingSession(
                scaffold=scaffold, hooks=hooks + [end], save_checkpoint_secs=None,
                save_summaries_steps=None, log_step_count_steps=None) as sess:
            while not sess.should_stop() and runs < 20:  # 20: a bound for a hook that never stops
                run(sess)
                runs += 1
    V1.summary.FileWriterCache.clear()
    points = [[value.tag, event.step, value.simple_value]
              for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*")))
              for event in V1.train.summary_iterator(path)
              for value in event.summary.value if value.tag == "loss"]
    return {"runs": runs, "state": end.state, "summaries": points,
            "final": {k: np.asarray(v).tolist() for k, v in final.final_ops_values.items()}}


results = {"fused": train(True, os.path.join(sys.argv[1], "fused")),
           "single": train(False, os.path.join(sys.argv[1], "single"))}
print("RESULTS " + json.dumps(results))
'''


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("distributed")
    (directory / "cases.py").write_text(DISTRIBUTED)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=root)
    done = subprocess.run([sys.executable, str(directory / "cases.py"), str(directory)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def test_distributed_stop_at_step_stops_where_single_distributed_steps_stop(distributed):
    """unrolled.run(sess) under ms.distribute.unroll: the hooks see the runs that train (before,
    StopAtStepHook(last_step=12) never stopped: 20 runs, global step 80). Three runs of 4,
    then every copy of every variable bitwise that of 12 hand-written single distributed steps
    stopped by TensorFlow's StopAtStepHook."""
    fused, single = distributed["fused"], distributed["single"]
    assert (fused["runs"], single["runs"]) == (3, 12)
    assert sorted(fused["state"]) == sorted(single["state"])
    assert "global_step@1" in fused["state"] and "w/Adam@1" in fused["state"]
    differ = [name for name in fused["state"] if fused["state"][name] != single["state"][name]]
    assert not differ, f"not bitwise equal: {differ}"


def test_distributed_step_summaries_are_single_distributed_steps(distributed):
    """StepSummaryHook against SummarySaverHook(save_steps=1) on the single steps' reduced loss:
    the same (tag, global step, value) for steps 1..12."""
    single = distributed["single"]["summaries"]
    assert [step for _, step, _ in single] == list(range(1, 13))
    assert distributed["fused"]["summaries"] == single


def test_distributed_final_ops_hook_trains_no_step(distributed):
    """FinalOpsHook: the global step at end() is 12, as TensorFlow's FinalOpsHook reads it for
    single steps, and the losses are the last run's (steps 9..12, the single steps' values)."""
    fused, single = distributed["fused"], distributed["single"]
    assert fused["final"]["step"] == single["final"]["step"] == 12
    assert fused["final"]["loss"] == [v for _, step, v in single["summaries"] if step > 8]
