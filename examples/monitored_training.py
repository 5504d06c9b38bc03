"""A classic TF1 training script, and the same script fused: N steps per sess.run.

The classic script: a tf.data pipeline, a two-layer classifier, Adam, and a
MonitoredTrainingSession that saves a checkpoint every 8 steps, writes the loss
summary at every step and stops at step 22. The fused one changes three things
(marked ``# fused:`` below):

    optimizer.minimize(loss, global_step)            ->  ms.unroll(model, optimizer, 4, ...)
    MonitoredTrainingSession(hooks=[StopAtStepHook])  ->  ms.hooks.monitored_training_session
    sess.run(train_op)                               ->  sess.run(unrolled.train_op)

Runs make 4 steps, and 22 is not a multiple of 4: the last run is shortened to 2
(loop mode's ``steps_per_run``). Both end at global step 22 with bitwise equal
weights and Adam slots, checkpoints at the same global steps and the same loss
summary at every step. The fused script, stopped at step 10 and restarted, resumes
from its checkpoint and ends bitwise where the uninterrupted one did.

    python examples/monitored_training.py [LOGDIR]    (default: tensorboard_logs/monitored_training)
"""

import glob
import os
import shutil
import sys

import numpy as np
import tensorflow as tf

import multistep as ms

V1 = tf.compat.v1
STEPS, LAST_STEP, SAVE_STEPS, BATCH = 4, 22, 8, 16
rng = np.random.RandomState(0)
FEATURES = rng.randn(LAST_STEP * BATCH, 6).astype(np.float32)
LABELS = (FEATURES[:, 0] + FEATURES[:, 1] ** 2 > 1).astype(np.int32)


def model(x, y):
    init = V1.glorot_uniform_initializer(seed=1)
    hidden = tf.nn.relu(tf.matmul(x, V1.get_variable("hidden/kernel", [6, 16], initializer=init))
                        + V1.get_variable("hidden/bias", [16], initializer=V1.zeros_initializer()))
    logits = (tf.matmul(hidden, V1.get_variable("out/kernel", [16, 2], initializer=init))
              + V1.get_variable("out/bias", [2], initializer=V1.zeros_initializer()))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def latest_step(logdir):
    path = tf.train.latest_checkpoint(logdir)
    return int(path.rsplit("-", 1)[1]) if path else 0


def train(logdir, last_step, *, fused):
    with tf.Graph().as_default():
        global_step = V1.train.get_or_create_global_step()
        # resuming: skip the batches the checkpoint's steps have used
        data = (tf.data.Dataset.from_tensor_slices((FEATURES, LABELS)).batch(BATCH)
                .skip(latest_step(logdir)))
        iterator = V1.data.make_one_shot_iterator(data)
        optimizer = V1.train.AdamOptimizer(0.01)
        if not fused:
            loss = model(*iterator.get_next())
            train_op = optimizer.minimize(loss, global_step=global_step)
            V1.summary.scalar("loss", loss)
            session = V1.train.MonitoredTrainingSession(
                checkpoint_dir=logdir, save_checkpoint_steps=SAVE_STEPS, save_summaries_steps=1,
                hooks=[V1.train.StopAtStepHook(last_step=last_step)])
        else:
            unrolled = ms.unroll(model, optimizer, STEPS, inputs=iterator,  # fused:
                                 global_step=global_step, mode="while_loop")
            train_op = unrolled.train_op  # fused:
            session = ms.hooks.monitored_training_session(  # fused:
                unrolled, checkpoint_dir=logdir, save_checkpoint_steps=SAVE_STEPS,
                save_summaries_steps=1, last_step=last_step)
        runs = 0
        with session as sess:
            while not sess.should_stop():
                sess.run(train_op)
                runs += 1
    V1.summary.FileWriterCache.clear()  # flush and close the summary writers
    return runs


def checkpoints(logdir):
    """global step -> {variable: value} of every checkpoint kept in ``logdir``."""
    state = V1.train.get_checkpoint_state(logdir)
    out = {}
    for path in state.all_model_checkpoint_paths:
        reader = tf.train.load_checkpoint(path)
        out[int(path.rsplit("-", 1)[1])] = {
            name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    return out


def loss_summaries(logdir):
    return sorted((event.step, value.simple_value)
                  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
                  for event in V1.train.summary_iterator(path)
                  for value in event.summary.value if value.tag == "loss")


def max_delta(a, b):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(a[n].astype(np.float64) - b[n]))) if a[n].size else 0.0
               for n in a)


def bitwise(a, b):
    return sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)


root = sys.argv[1] if len(sys.argv) > 1 else os.path.join("tensorboard_logs", "monitored_training")
dirs = {name: os.path.join(root, name) for name in ("classic", "fused", "fused_resumed")}
for logdir in dirs.values():
    shutil.rmtree(logdir, ignore_errors=True)

runs = {"classic": train(dirs["classic"], LAST_STEP, fused=False),
        "fused": train(dirs["fused"], LAST_STEP, fused=True)}
saved = {name: checkpoints(dirs[name]) for name in runs}
summaries = {name: loss_summaries(dirs[name]) for name in runs}
for name in runs:
    final = saved[name][max(saved[name])]
    print(f"{name:>7}: {runs[name]:>2} runs, final global step {final['global_step']}, "
          f"checkpoints at global steps {sorted(saved[name])}, "
          f"{len(summaries[name])} loss summaries (steps {summaries[name][0][0]}.."
          f"{summaries[name][-1][0]})")

same_steps = sorted(saved["classic"]) == sorted(saved["fused"])
deltas = [max_delta(saved["classic"][s], saved["fused"][s]) for s in sorted(saved["classic"])]
same_checkpoints = same_steps and all(bitwise(saved["classic"][s], saved["fused"][s])
                                      for s in saved["classic"])
same_summaries = summaries["classic"] == summaries["fused"]
print(f"classic vs fused, every checkpoint ({len(saved['fused'][LAST_STEP])} variables: weights, "
      f"Adam slots and powers, global step): max |delta| = {max(deltas):g}; "
      f"per-step loss summaries {'identical' if same_summaries else 'DIFFER'}")

# The fused script, stopped at step 10 (the third run shortened to 2 steps), then run
# again to 22: it restores step 10's checkpoint and skips the 10 batches used.
first = train(dirs["fused_resumed"], 10, fused=True)
second = train(dirs["fused_resumed"], LAST_STEP, fused=True)
resumed = checkpoints(dirs["fused_resumed"])
resumed_delta = max_delta(resumed[LAST_STEP], saved["fused"][LAST_STEP])
resumed_same = bitwise(resumed[LAST_STEP], saved["fused"][LAST_STEP])
print(f"fused, stopped at 10 ({first} runs) and resumed ({second} runs): checkpoints at "
      f"{sorted(resumed)}, final global step {resumed[LAST_STEP]['global_step']}, max |delta| to "
      f"the uninterrupted run = {resumed_delta:g}")

if same_checkpoints and same_summaries and resumed_same:
    print("same checkpoint steps, same per-step summaries, weights and slots bitwise equal; "
          "resumed run bitwise equal")
else:
    print(f"DIFFER: checkpoints {same_checkpoints}, summaries {same_summaries}, "
          f"resumed {resumed_same}")
    sys.exit(1)
