"""SessionRunHooks for ``tf.compat.v1.train.MonitoredTrainingSession`` when a run is N steps.

TensorFlow's hooks assume one global step per ``sess.run``. With ``ms.unroll`` a
run makes N steps (loop mode: ``unrolled.steps_per_run`` of them), so use these
instead:

    TensorFlow's hook                 with an ms.unroll train op
    StopAtStepHook(last_step=L)       ms.hooks.StopAtStepHook(unrolled, L): shortens
                                      the last run
    StopAtStepHook(num_steps=S)       ms.hooks.StopAtStepHook(unrolled, num_steps=S)
    SummarySaverHook(save_steps=S)    ms.hooks.StepSummaryHook(unrolled, dir, S): a
                                      point per step
    LoggingTensorHook(every_n_iter=S) ms.hooks.LoggingHook(unrolled, S): a line per S
                                      steps
    NanTensorHook(loss)               ms.hooks.NanHook(unrolled): checks the N losses
    FinalOpsHook(final_ops)           ms.hooks.FinalOpsHook(unrolled, final_ops):
                                      unrolled.losses as the last run left them
                                      (TensorFlow's would run N steps)
    CheckpointSaverHook,              ms.hooks.steps_per_run_aware(hook, unrolled)
      StepCounterHook
    (none)                            ms.hooks.AutoStepsHook(unrolled): chooses N
                                      between runs
    (none)                            ms.hooks.InputExhaustedHook(unrolled): says where
                                      a tf.data input ran out

``ms.hooks.monitored_training_session(unrolled, ...)`` builds a
MonitoredTrainingSession with them in place of its own default hooks.

These hooks add fetches only to runs that train (whose fetches depend on
``unrolled.train_op``): any other ``mon_sess.run`` (an evaluation, a read of the
global step) runs no step. From the ``[n]`` losses and records of a run and the
global step read after it they know every step's global step, without an extra
``sess.run``. They build that read in ``begin()``, before MonitoredSession
finalizes the graph. An optimizer may skip a step's increment of the global step
(a loss-scale optimizer does when the gradients overflow): then, from the global
step before and after the run, they know the global step of the run's last step,
and of the others only when the run advanced it by all its steps or by none.
"""

import collections
import math
import numbers
import os
import statistics
import time

import numpy as np
import tensorflow as tf

from multistep.compiler.compile import Compiled
from multistep.builder.unroll import Unrolled

__all__ = ["AutoStepsHook", "FinalOpsHook", "InputExhaustedHook", "LoggingHook", "NanHook",
           "NonFiniteLossError", "StepSummaryHook", "StopAtStepHook", "monitored_training_session",
           "steps_per_run_aware"]

V1 = tf.compat.v1
logging = V1.logging

Run = collections.namedtuple("Run", "steps losses records summaries")
Run.__doc__ = """One training run: ``losses[k]``, ``records[name][k]`` and ``summaries[k]``
(the serialized summaries ``loss_fn`` built, where fetched; else ``summaries`` is None)
belong to the inner step after whose apply the global step was ``steps[k]`` (None where the
run does not tell: see ``_steps``; ``steps`` is None without a global step)."""


class _Runs:
    """Which runs train ``unrolled``, and what each of them did: the part every hook here shares.

    ``before(run_context)`` returns the fetches to add (None for a run that does not
    train); ``after(results)`` turns what they fetched into a ``Run``.
    """

    def __init__(self, unrolled, who, *, needs_global_step=True):
        if not isinstance(unrolled, (Unrolled, Compiled)):
            raise TypeError(f"{who} takes the Unrolled that ms.unroll returned (or the "
                            f"Compiled of ms.compile), got "
                            f"{type(unrolled).__name__}.")
        if unrolled.losses is None:
            raise ValueError(
                f"{who}: {unrolled.name} fetches no loss (ms.compile found none: none keyed "
                f"'loss' in a dict, and not exactly one float scalar that a variable's "
                f"gradient flows from), and the hooks place each inner step by its loss. "
                f"Compile the loss in a dict under the key 'loss', e.g. ms.compile({{'loss': "
                f"d_loss, 'g_loss': g_loss, 'train': train_op}}, steps).")
        if needs_global_step and unrolled.global_step is None:
            raise ValueError(
                f"{who} needs the global step to place each inner step: build with "
                f"ms.unroll(..., global_step=tf.compat.v1.train.get_or_create_global_step()).")
        self.unrolled = unrolled
        self._step_after = None  # the global step, read after the run's last step
        self._before = None  # the global step before the next run (None: not known)
        self._trains = {}  # the op names a run fetches -> whether they run train_op
        self.training = False
        self._summaries = False  # fetch unrolled.summaries (StepSummaryHook)

    def fetch_summaries(self):
        self._summaries = True

    def begin(self):
        """Builds the read of the global step after the run (MonitoredSession calls the
        hooks' ``begin`` before it finalizes the graph)."""
        unrolled = self.unrolled
        graph = unrolled.train_op.graph
        if unrolled.global_step is None or graph.finalized:
            return
        with graph.as_default(), V1.name_scope(f"{unrolled.name}/hooks/"), \
                tf.control_dependencies([unrolled.train_op]):
            self._step_after = tf.identity(unrolled.global_step.read_value(),
                                           name="global_step_after_run")

    def start(self, session):
        """Reads the global step as a session starts (None without one); runs count from it."""
        if self.unrolled.global_step is None:
            return None
        self._before = int(session.run(self.unrolled.global_step))
        return self._before

    def before(self, run_context):
        self.training = self._runs_train(run_context.original_args.fetches)
        if not self.training:
            return None
        fetches = {"losses": self.unrolled.losses, "records": dict(self.unrolled.records)}
        if self._summaries and self.unrolled.summaries is not None:
            fetches["summaries"] = self.unrolled.summaries
        if self._step_after is not None:
            fetches["global_step"] = self._step_after
        return V1.train.SessionRunArgs(fetches)

    def after(self, results, session):
        """The ``Run`` that ``before``'s fetches describe, or None if the run did not train."""
        if not self.training or results is None:
            return None
        losses = np.asarray(results["losses"]).reshape(-1)
        records = {k: np.asarray(v).reshape(-1) for k, v in results["records"].items()}
        steps = None
        if self.unrolled.global_step is not None:
            last = results.get("global_step")
            if last is None:  # the graph was finalized before begin(): read it now
                last = session.run(self.unrolled.global_step)
            steps = _steps(self._before, int(last), len(losses))
            self._before = int(last)
        summaries = results.get("summaries")
        return Run(steps, losses, records, None if summaries is None else list(summaries))

    def _runs_train(self, fetches):
        """Whether ``fetches`` (any nest of ops, tensors and names) depend on train_op."""
        graph = self.unrolled.train_op.graph
        ops = []
        for fetch in tf.nest.flatten(fetches, expand_composites=True):
            if isinstance(fetch, bytes):
                fetch = fetch.decode()
            if isinstance(fetch, str):
                fetch = graph.as_graph_element(fetch)
            op = getattr(fetch, "op", fetch)
            if isinstance(op, tf.Operation):
                ops.append(op)
        key = tuple(sorted(op.name for op in ops))
        if key not in self._trains:
            self._trains[key] = _depends_on(ops, self.unrolled.train_op)
        return self._trains[key]


def _steps(before, last, n):
    """The global step after each of a run's ``n`` steps (None where not known), from the
    global step ``before`` the run (None: not known) and ``last``, after it.

    A step advances the global step by one, or by none when its optimizer skips the
    increment (a loss-scale optimizer, when the gradients overflow), and the run does not
    record which steps did: a run that advanced it by all ``n`` or by none tells every
    step's; one in between only the last one's. A run that finds it advanced by more than
    ``n`` (another program shares the global step) or moved back, or whose start is not
    known, counts back from ``last``, one a step.
    """
    if before is None or not 0 <= last - before < n:
        return list(range(last - n + 1, last + 1))
    # After step k (from 0) it advanced at most k + 1 times, and the steps after it at
    # most once each: known where the two bounds meet.
    bounds = ((max(before, last - (n - 1 - k)), min(last, before + k + 1)) for k in range(n))
    return [low if low == high else None for low, high in bounds]


def _depends_on(ops, train_op):
    """Whether running ``ops`` runs ``train_op`` (or the last step it waits for)."""
    targets = {train_op, *train_op.control_inputs}
    seen, todo = set(), list(ops)
    while todo:
        op = todo.pop()
        if op in targets:
            return True
        if op in seen:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return False


def _every(every_n_steps, what):
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, numbers.Integral) \
            or every_n_steps < 1:
        raise ValueError(f"{what}: every_n_steps must be an int >= 1, got {every_n_steps!r}.")
    return int(every_n_steps)


class _StepTimer:
    """Which inner steps an every-n-steps hook acts on: the first step it sees, then each
    step at least ``every`` past the last one acted on (TensorFlow's SecondOrStepTimer
    rule, applied to every step instead of once per run)."""

    def __init__(self, every):
        self.every = every
        self.last = None

    def select(self, steps):
        """The indices in ``steps`` (a run's global steps; None: not known) to act on."""
        chosen = []
        for k, step in enumerate(steps):
            if step is not None and (self.last is None or step >= self.last + self.every):
                chosen.append(k)
                self.last = step
        return chosen


class StopAtStepHook(V1.train.SessionRunHook):
    """Stops training with the global step exactly ``last_step``, shortening the last run.

    As TensorFlow's ``StopAtStepHook``, it takes exactly one of ``last_step`` and
    ``num_steps``; ``num_steps`` counts from the global step read when the first
    session is created (``after_create_session``): a session re-created after an
    error keeps that ``last_step``.

    Before a run that trains, if fewer than ``unrolled.steps`` steps are left, it
    lowers ``unrolled.steps_per_run`` to what is left (never raises it: another hook,
    ``AutoStepsHook``, may have chosen fewer); after a run that reaches
    ``last_step`` it requests a stop. A session that starts at or past
    ``last_step`` (resumed from a checkpoint of a finished run) stops before its
    first run, where TensorFlow's hook would run one more.

    In unrolled mode every run makes exactly ``unrolled.steps`` steps: a
    ``last_step`` that the starting global step cannot reach by whole runs is a
    ``ValueError`` when the session is created.

    Example (``unrolled`` built with ``mode="while_loop"`` and ``global_step=``):

        with tf.compat.v1.train.MonitoredTrainingSession(
                hooks=[ms.hooks.StopAtStepHook(unrolled, last_step=1000)]) as sess:
            while not sess.should_stop():
                sess.run(unrolled.train_op)
    """

    def __init__(self, unrolled, last_step=None, *, num_steps=None):
        self._runs = _Runs(unrolled, "StopAtStepHook")
        if (last_step is None) == (num_steps is None):  # TensorFlow's messages
            raise ValueError("StopAtStepHook: " + (
                "One of num_steps or last_step must be specified." if last_step is None else
                "Only one of num_steps or last_step can be specified."))
        for name, value in (("last_step", last_step), ("num_steps", num_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, numbers.Integral) or value < 0):
                raise ValueError(f"StopAtStepHook: {name} must be an int >= 0, got {value!r}.")
        self._last_step = None if last_step is None else int(last_step)
        self._num_steps = None if num_steps is None else int(num_steps)
        self._step = None  # the global step now, as the last run left it
        self._increment = 1  # what a step adds to the global step (None: not known yet)

    def begin(self):
        self._runs.begin()

    def after_create_session(self, session, coord):
        unrolled = self._runs.unrolled
        self._step = self._runs.start(session)
        if self._last_step is None:
            self._last_step = self._step + self._num_steps
        left = self._last_step - self._step
        self._increment = getattr(unrolled, "step_increment", 1)
        if left <= 0:
            coord.request_stop()
        elif unrolled.steps_per_run is None and left % unrolled.steps:
            runs = -(-left // unrolled.steps)
            raise ValueError(
                f"StopAtStepHook: {unrolled.name} was built in mode='unrolled', so every run "
                f"makes exactly {unrolled.steps} steps, and from global step {self._step} it "
                f"cannot stop at last_step={self._last_step}: {runs} runs would end at "
                f"{self._step + runs * unrolled.steps}. Build it with mode='while_loop' "
                f"(the last run is shortened), or choose a last_step of {self._step} plus a "
                f"multiple of {unrolled.steps}.")

    def before_run(self, run_context):
        args = self._runs.before(run_context)
        unrolled = self._runs.unrolled
        if args is not None and unrolled.steps_per_run is not None:
            # The steps that reach last_step (rounded up, as TensorFlow's hook stops at the
            # first global step at or past it), each advancing the global step by
            # ``step_increment`` (measured at the first run where the build cannot tell).
            left = -(-(self._last_step - self._step) // (self._increment or 1))
            if left < unrolled.steps:
                session = run_context.session
                if session.run(unrolled._run_length.read) > left:
                    unrolled.set_steps_per_run(session, max(left, 1))
        return args

    def after_run(self, run_context, run_values):
        before = self._step
        run = self._runs.after(run_values.results, run_context.session)
        if run is not None:
            self._step = run.steps[-1]
            advanced, n = self._step - before, len(run.losses)
            if self._increment is None and advanced > 0 and advanced % n == 0:
                self._increment = advanced // n
        if self._step >= self._last_step:
            run_context.request_stop()


class _RunsHook(V1.train.SessionRunHook):
    """A hook that reads each training run's ``[n]`` vectors through ``self._runs``."""

    def begin(self):
        self._runs.begin()

    def after_create_session(self, session, coord):
        self._runs.start(session)

    def before_run(self, run_context):
        return self._runs.before(run_context)

    def _run(self, run_context, run_values):
        """The run's vectors, or None for a run that made no step."""
        return self._runs.after(run_values.results, run_context.session)


class _EveryNStepsHook(_RunsHook):
    """The protocol the per-step hooks share: fetch the run's ``[n]`` vectors, then hand
    the inner steps chosen every ``every_n_steps`` to ``_emit(global_step, values)``.
    A step whose global step is not known (its optimizer skipped increments) is left out:
    written at a guessed step, its value would be placed where it does not belong."""

    def __init__(self, unrolled, every_n_steps, who):
        self._runs = _Runs(unrolled, who)
        self._every = _every(every_n_steps, who)
        self._who = who
        self._timer = None
        self._told = False

    def begin(self):
        super().begin()
        self._timer = _StepTimer(self._every)

    def after_run(self, run_context, run_values):
        run = self._run(run_context, run_values)
        if run is None:
            return
        series = {"loss": run.losses, **run.records}
        for k in self._timer.select(run.steps):
            self._emit(run.steps[k], {tag: values[k] for tag, values in series.items()},
                       None if run.summaries is None else run.summaries[k])
        unknown = run.steps.count(None)
        if unknown and not self._told:
            self._told = True
            logging.warning(
                "%s: a run of %d steps advanced the global step by fewer than %d, to %d (its "
                "optimizer skipped increments, as a loss-scale optimizer does when the gradients "
                "overflow), and which steps did is not recorded: the values of the %d steps whose "
                "global step is not known are left out, here and in any such run.", self._who,
                len(run.steps), len(run.steps), run.steps[-1], unknown)
        self._emitted()

    def _emit(self, global_step, values, summary=None):
        raise NotImplementedError

    def _emitted(self):
        """Called after each run's values."""


class StepSummaryHook(_EveryNStepsHook):
    """A TensorBoard scalar for every inner step: ``loss`` and each ``records`` entry;
    and the ``tf.summary`` ops ``loss_fn`` built (``Unrolled.summaries``), each step's.

    Each value is written at the global step its step's apply made, as TensorFlow's
    ``SummarySaverHook(save_steps=every_n_steps)`` writes a single step's
    ``tf.compat.v1.summary.scalar("loss", loss)``: at the first step of the session,
    then every ``every_n_steps`` steps after the last one written. The values come
    from the ``[n]`` vectors the run returns: no extra ``sess.run``. A run whose input
    runs out midway has its applied steps' losses written at ``end`` where the program
    keeps them (loop mode), else a warning says they are not. Writes through
    ``tf.compat.v1.summary.FileWriterCache`` (the writer the checkpoint and step
    counter hooks share for the same directory).
    """

    def __init__(self, unrolled, output_dir, every_n_steps=1):
        if not isinstance(output_dir, (str, bytes, os.PathLike)) or not output_dir:
            raise TypeError(f"StepSummaryHook: output_dir must be a directory path, got "
                            f"{output_dir!r}.")
        super().__init__(unrolled, every_n_steps, "StepSummaryHook")
        self._runs.fetch_summaries()
        self._output_dir = output_dir
        self._writer = None
        self._pending = False  # a training run that has not returned

    def before_run(self, run_context):
        args = super().before_run(run_context)
        self._pending = args is not None
        return args

    def after_run(self, run_context, run_values):
        self._pending = False
        super().after_run(run_context, run_values)

    def begin(self):
        super().begin()
        self._writer = V1.summary.FileWriterCache.get(self._output_dir)

    def _emit(self, global_step, values, summary=None):
        self._writer.add_summary(V1.Summary(value=[
            V1.Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()]),
            global_step)
        if summary:  # what loss_fn's tf.summary ops wrote in this step
            self._writer.add_summary(summary, global_step)

    def _emitted(self):
        self._writer.flush()

    def end(self, session):
        if self._pending:  # the input ran out during the last run
            self._cut_short(session)
        self._writer.flush()

    def _cut_short(self, session):
        """Writes the losses of the steps a run cut short by its input applied, where
        the program keeps them (loop mode: ``ms.compile``'s, ``ms.unroll``'s over an
        iterator); else says they are not written."""
        unrolled, before = self._runs.unrolled, self._runs._before  # noqa: SLF001
        run_length = unrolled._run_length  # noqa: SLF001
        kept = (unrolled._partial.get(id(unrolled.losses))  # noqa: SLF001
                if isinstance(unrolled, Compiled) else unrolled._kept_losses)  # noqa: SLF001
        if kept is None or before is None or run_length is None or run_length.done is None:
            logging.warning(
                "StepSummaryHook: the input ran out during a run of %s, and the summaries of "
                "the steps it applied are not written: the program keeps no values of a "
                "run cut short (loop mode does: ms.compile's, or ms.unroll's over a tf.data "
                "iterator).", unrolled.name)
            return
        applied, losses = session.run([run_length.done, kept])
        increment = getattr(unrolled, "step_increment", 1) or 1
        steps = [before + increment * (k + 1) for k in range(applied)]
        for k in self._timer.select(steps):
            self._emit(steps[k], {"loss": losses[k]})


class LoggingHook(_EveryNStepsHook):
    """Logs the loss (and records) of one inner step in every ``every_n_steps``, with its
    global step, at INFO through ``tf.compat.v1.logging``:

        multistep: global step 12: loss = 0.6931472, grad_norm = 0.25

    The steps are chosen as ``StepSummaryHook`` chooses them; values print as
    TensorFlow's ``LoggingTensorHook`` prints a float32 (shortest round-trip digits).
    """

    def __init__(self, unrolled, every_n_steps):
        super().__init__(unrolled, every_n_steps, "LoggingHook")

    def _emit(self, global_step, values, summary=None):
        logging.info("%s: global step %d: %s", self._runs.unrolled.name, global_step,
                     ", ".join(f"{tag} = {value!s}" for tag, value in values.items()))


class NonFiniteLossError(V1.train.NanLossDuringTrainingError):
    """An inner step's loss was NaN or infinite (``NanHook(fail_on_nan_loss=True)``)."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message

    def __str__(self):
        return self.message


class NanHook(_RunsHook):
    """Checks the loss of every inner step of a run (TensorFlow's ``NanTensorHook``
    checks one scalar, the run's): NaN or infinite in any of them raises
    ``NonFiniteLossError`` (a ``NanLossDuringTrainingError``) naming the first such
    step, or with ``fail_on_nan_loss=False`` logs it and requests a stop.

    With ``ms.unroll``'s in-graph ``nonfinite=`` policy:
    ``"raise"`` (the default) stops the run itself at the first non-finite loss or
    gradient, before that step's apply, with an ``InvalidArgumentError``: this hook
    never sees one. ``"skip"``: the run completes, the non-finite steps changed no
    weight, and this hook then stops training (use it to stop, or leave it out to
    train on past skipped steps). ``"ignore"``: the step was applied, and so were the
    later steps of that run; this hook stops training after the run, as
    ``NanTensorHook`` does after a single step.
    """

    def __init__(self, unrolled, fail_on_nan_loss=True):
        self._runs = _Runs(unrolled, "NanHook", needs_global_step=False)
        self._fail = bool(fail_on_nan_loss)

    def after_run(self, run_context, run_values):
        run = self._run(run_context, run_values)
        if run is None:
            return
        bad = np.flatnonzero(~np.isfinite(run.losses))
        if not bad.size:
            return
        k = int(bad[0])
        where = f"inner step {k + 1} of {len(run.losses)}"
        if run.steps is not None and run.steps[k] is not None:
            where += f" (global step {run.steps[k]})"
        message = (f"{self._runs.unrolled.name}: loss = {run.losses[k]} at {where}; "
                   f"{bad.size} of the run's {len(run.losses)} losses are not finite.")
        if self._fail:
            logging.error(message)
            raise NonFiniteLossError(message)
        logging.warning(message)
        run_context.request_stop()


class FinalOpsHook(_RunsHook):
    """TensorFlow's ``FinalOpsHook`` for an N-step train op: ``final_ops_values`` holds
    ``final_ops`` (a tensor, list or dict) as training left them, and ``end()`` trains no step.

    Fetching ``unrolled.losses`` runs N steps, so TensorFlow's hook, which fetches its
    ops at ``end()``, would train N steps past the stop. Here ``unrolled.losses`` and
    the ``unrolled.records`` tensors get the values the last training run returned
    (fetched with that run, as every hook here fetches them; None if no run trained):
    ``[n]``, the last n steps' values. The other ops run at ``end()``, as TensorFlow's
    hook runs them; any of them that would train is a ``ValueError``.
    """

    def __init__(self, unrolled, final_ops, final_ops_feed_dict=None):
        self._runs = _Runs(unrolled, "FinalOpsHook", needs_global_step=False)
        self._final_ops, self._feed = final_ops, final_ops_feed_dict
        # What a run returns, by tensor name: "loss" and each record.
        self._from_run = {unrolled.losses.name: "loss",
                          **{t.name: key for key, t in unrolled.records.items()}}
        trains = [getattr(op, "name", op) for op in tf.nest.flatten(final_ops)
                  if getattr(op, "name", None) not in self._from_run and self._runs._runs_train(op)]
        if trains:
            raise ValueError(
                f"FinalOpsHook: fetching {', '.join(map(str, trains))} at end() would run "
                f"{unrolled.name}'s steps again (it depends on its train op). Pass "
                f"unrolled.losses or an unrolled.records tensor itself (this hook gives the "
                f"last run's values), or ops that only read variables.")
        self._last = {}
        self._final_ops_values = None

    @property
    def final_ops_values(self):
        return self._final_ops_values

    def after_run(self, run_context, run_values):
        run = self._run(run_context, run_values)
        if run is not None:
            self._last = {"loss": run.losses, **run.records}

    def end(self, session):
        if self._final_ops is None:
            return
        flat = tf.nest.flatten(self._final_ops)
        keys = [self._from_run.get(getattr(op, "name", None)) for op in flat]
        ran = iter(session.run([op for op, key in zip(flat, keys) if key is None],
                               feed_dict=self._feed))
        self._final_ops_values = tf.nest.pack_sequence_as(
            self._final_ops, [next(ran) if key is None else self._last.get(key) for key in keys])


class InputExhaustedHook(V1.train.SessionRunHook):
    """Says how many steps of the last run were applied when a ``tf.data`` input ran out.

    MonitoredTrainingSession ends training cleanly on ``OutOfRangeError`` and says
    nothing; with runs of N steps the input may run out in the middle of one. At
    ``end()`` this hook logs (WARNING) and keeps in ``message`` where training
    stopped, e.g. "multistep: the input ran out during a run: the first 2 of its 4
    steps were applied; the global step is now 10." ``steps_applied`` holds the 2.
    Both stay None when no run was cut short. ``values``: the applied steps' values
    of that run, as ``fused.run`` returns a run's, where the program keeps them
    (``ms.compile``'s loop mode); else None.
    """

    def __init__(self, unrolled):
        self._runs = _Runs(unrolled, "InputExhaustedHook")
        self._step = None
        self._pending = None  # the global step before a run that has not returned
        self.message = None
        self.steps_applied = None
        self.values = None

    def begin(self):
        self._runs.begin()

    def after_create_session(self, session, coord):
        self._step = self._runs.start(session)
        self._pending = None

    def before_run(self, run_context):
        args = self._runs.before(run_context)
        if args is not None:
            self._pending = self._step
        return args

    def after_run(self, run_context, run_values):
        run = self._runs.after(run_values.results, run_context.session)
        if run is not None:
            self._step = run.steps[-1]
        self._pending = None

    def end(self, session):
        if self._pending is None:
            return
        unrolled = self._runs.unrolled
        now = int(session.run(unrolled.global_step))
        length = (unrolled.steps if unrolled.steps_per_run is None
                  else int(session.run(unrolled._run_length.read)))
        self.steps_applied = now - self._pending
        self.message = (f"{unrolled.name}: the input ran out during a run: the first "
                        f"{self.steps_applied} of its {length} steps were applied; the global "
                        f"step is now {now}.")
        applied = getattr(unrolled, "_applied", None)  # (ms.compile's loop mode keeps them)
        self.values = None if applied is None else applied(session)
        logging.warning("%s", self.message)


class AutoStepsHook(V1.train.SessionRunHook):
    """Chooses ``unrolled.steps_per_run`` between runs so that a run takes about
    ``target_seconds`` (loop mode only).

    The first run of a session makes 1 step and is not measured (it pays for graph
    set-up). After each later run, the time per step is the median of the last 5
    runs at the current length; the ideal length is ``target_seconds`` over it.
    The length moves only when the ideal is more than 25% away from it (hysteresis:
    noise does not make it oscillate), and only after 3 runs at the current length
    unless the ideal is more than 2x away; a move more than 4x away goes halfway
    (geometrically). It stays in ``1..min(steps, max_steps)``. A run's time is
    measured from this hook's ``before_run`` to its ``after_run``: list it first so
    that no other hook's ``after_run`` (a checkpoint save) falls inside.

    With a per-run overhead ``a`` and a per-step cost ``b``, the length approaches
    ``(target_seconds - a) / b`` and settles within 25% of it.

    ``timer``: the clock, in seconds (injectable for tests). ``steps_per_run``: the
    length chosen last.
    """

    BAND = 1.25      # no move while the ideal is within this factor of the current length
    FAR = 2.0        # beyond this factor, move without waiting for more runs
    HALFWAY = 4.0    # beyond this factor, move geometrically halfway
    WINDOW = 5       # runs whose median time per step is used
    PATIENCE = 3     # runs at a length before a move within FAR

    def __init__(self, unrolled, target_seconds=0.5, max_steps=None, timer=time.perf_counter):
        self._runs = _Runs(unrolled, "AutoStepsHook", needs_global_step=False)
        if unrolled.steps_per_run is None:
            raise TypeError(
                f"AutoStepsHook: {unrolled.name} was built in mode='unrolled', whose runs "
                f"always make {unrolled.steps} steps; build it with mode='while_loop' "
                f"(steps= is then the most a run makes) to let the run length vary.")
        if isinstance(target_seconds, bool) or not isinstance(target_seconds, numbers.Real) \
                or not target_seconds > 0:
            raise ValueError(f"AutoStepsHook: target_seconds must be > 0, got {target_seconds!r}.")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(
                max_steps, numbers.Integral) or max_steps < 1):
            raise ValueError(f"AutoStepsHook: max_steps must be an int >= 1 or None, got "
                             f"{max_steps!r}.")
        self._target = float(target_seconds)
        self._cap = unrolled.steps if max_steps is None else min(unrolled.steps, int(max_steps))
        self._timer = timer
        self.steps_per_run = None
        self._per_step = []
        self._started = None
        self._measured = False

    def begin(self):
        self._runs.begin()

    def after_create_session(self, session, coord):
        self.steps_per_run = None  # a new session starts from `steps`: set it whatever it was
        self._set(session, 1)
        self._measured = False

    def before_run(self, run_context):
        args = self._runs.before(run_context)
        if args is not None:
            self._started = self._timer()
        return args

    def after_run(self, run_context, run_values):
        run = self._runs.after(run_values.results, run_context.session)
        if run is None:
            return
        elapsed = self._timer() - self._started
        if not self._measured:  # the session's first run: set-up, not a measure
            self._measured = True
            return
        self._per_step = (self._per_step + [elapsed / len(run.losses)])[-self.WINDOW:]
        n = self.steps_per_run
        ratio = self._target / max(statistics.median(self._per_step), 1e-12) / n
        if 1 / self.BAND <= ratio <= self.BAND:
            return
        if len(self._per_step) < self.PATIENCE and 1 / self.FAR <= ratio <= self.FAR:
            return
        if not 1 / self.HALFWAY <= ratio <= self.HALFWAY:
            ratio = math.sqrt(ratio)
        self._set(run_context.session, max(1, min(self._cap, round(n * ratio))))

    def _set(self, session, n):
        if n != self.steps_per_run:
            self._runs.unrolled.set_steps_per_run(session, n)
            self.steps_per_run = n
            self._per_step = []


def steps_per_run_aware(hook, unrolled):
    """TensorFlow's ``CheckpointSaverHook`` or ``StepCounterHook``, told before each of
    its ``after_run`` calls how many steps the run made (its private
    ``_set_steps_per_run``, which TPUEstimator uses the same way).

    Told nothing, ``StepCounterHook`` assumes 1 step per run and notices that its
    interval has passed one run late; ``CheckpointSaverHook`` assumes 1,000,000 and so
    reads the global step after every run. Told the true count, both decide on the
    global step after the run, and read it only when their interval has passed.

    What is "right" when the interval is not a multiple of the run length: TensorFlow's
    own rule, on the true global step. ``CheckpointSaverHook(save_steps=S)`` writes a
    checkpoint when the session starts, at the end of the first run whose global step
    is at least S past the previous checkpoint's, and when training ends (at the
    final global step, if not just written). The interval is thus S rounded up to
    whole runs: with runs of N = 4 steps, S = 8 gives 0, 8, 16, ... (the single-step
    checkpoints), S = 6 gives 0, 8, 16, 24, ... A checkpoint is never a run late, and
    its step is always the end of a run. For the single-step checkpoint steps, choose
    S a multiple of N (runs shortened by ``StopAtStepHook`` come last, and training
    ends with a checkpoint anyway). ``StepCounterHook(every_n_steps=S)`` likewise
    reports steps per second at the end of the first run S steps past the last report.
    """
    if not hasattr(hook, "_set_steps_per_run"):
        replacement = {"SummarySaverHook": "ms.hooks.StepSummaryHook",
                       "LoggingTensorHook": "ms.hooks.LoggingHook",
                       "NanTensorHook": "ms.hooks.NanHook",
                       "StopAtStepHook": "ms.hooks.StopAtStepHook"}.get(type(hook).__name__)
        instead = f"; use {replacement} instead" if replacement else ""
        raise TypeError(
            f"steps_per_run_aware: {type(hook).__name__} cannot be told the steps of a run "
            f"(it has no _set_steps_per_run; TensorFlow's CheckpointSaverHook and "
            f"StepCounterHook have){instead}.")
    return _StepsPerRunAware(hook, unrolled)


class _StepsPerRunAware(V1.train.SessionRunHook):
    """``hook``, with ``_set_steps_per_run(n)`` called before its ``after_run`` (0 for a
    run that did not train)."""

    def __init__(self, hook, unrolled):
        self.hook = hook
        self._runs = _Runs(unrolled, type(hook).__name__, needs_global_step=False)

    def begin(self):
        self._runs.begin()
        self.hook.begin()

    def after_create_session(self, session, coord):
        self.hook.after_create_session(session, coord)

    def before_run(self, run_context):
        inner = self.hook.before_run(run_context)
        ours = self._runs.before(run_context)
        fetches = {}
        if inner is not None and inner.fetches is not None:
            fetches["hook"] = inner.fetches
        if ours is not None:
            fetches["run"] = ours.fetches
        if inner is None and not fetches:
            return None
        return V1.train.SessionRunArgs(fetches or None,
                                       feed_dict=inner.feed_dict if inner else None,
                                       options=inner.options if inner else None)

    def after_run(self, run_context, run_values):
        results = run_values.results or {}
        run = self._runs.after(results.get("run"), run_context.session)
        self.hook._set_steps_per_run(0 if run is None else len(run.losses))
        self.hook.after_run(run_context, V1.train.SessionRunValues(
            results=results.get("hook"), options=run_values.options,
            run_metadata=run_values.run_metadata))

    def end(self, session):
        self.hook.end(session)


def monitored_training_session(unrolled, *, last_step=None, checkpoint_dir=None,
                               save_checkpoint_steps=None, save_checkpoint_secs=None,
                               summary_dir=None, save_summaries_steps=100,
                               log_step_count_steps=100, target_seconds=None, hooks=(),
                               chief_only_hooks=(), **session_args):
    """``tf.compat.v1.train.MonitoredTrainingSession`` for an N-step train op.

    The same defaults as TensorFlow's, with its default hooks replaced: per-step
    summaries (``StepSummaryHook``, ``save_summaries_steps``), a step counter and a
    checkpoint saver that know the steps of a run (``steps_per_run_aware``; a
    checkpoint every 600 s when ``checkpoint_dir`` is set and neither interval is),
    and ``InputExhaustedHook``. ``last_step`` adds ``StopAtStepHook``;
    ``target_seconds`` adds ``AutoStepsHook``, listed first so that its clock
    measures only the run. Other arguments (``is_chief``, ``config``, ``scaffold``,
    ``master``, ...) go to MonitoredTrainingSession. The summaries hold the loss and
    ``record=`` quantities of every step, not the graph's ``tf.summary`` ops (which
    would see one step per run).
    """
    if session_args.pop("save_summaries_secs", None) is not None:
        raise ValueError("monitored_training_session: save_summaries_secs is not supported; "
                         "per-step summaries are written every save_summaries_steps steps.")
    is_chief = session_args.get("is_chief", True)
    first, per_worker, chief = [], [], []
    if target_seconds is not None:
        first.append(AutoStepsHook(unrolled, target_seconds))
    if last_step is not None:
        per_worker.append(StopAtStepHook(unrolled, last_step))
    if unrolled.global_step is not None:
        per_worker.append(InputExhaustedHook(unrolled))
    summary_dir = summary_dir or checkpoint_dir
    if summary_dir and save_summaries_steps:
        chief.append(StepSummaryHook(unrolled, summary_dir, save_summaries_steps))
    if summary_dir and log_step_count_steps:
        chief.append(steps_per_run_aware(V1.train.StepCounterHook(
            every_n_steps=log_step_count_steps, output_dir=summary_dir), unrolled))
    if checkpoint_dir:
        if save_checkpoint_steps is None and save_checkpoint_secs is None:
            save_checkpoint_secs = 600
        chief.append(steps_per_run_aware(V1.train.CheckpointSaverHook(
            checkpoint_dir, save_steps=save_checkpoint_steps, save_secs=save_checkpoint_secs,
            scaffold=session_args.get("scaffold")), unrolled))
    # MonitoredTrainingSession runs chief_only_hooks, then hooks, in order.
    return V1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir, summary_dir=summary_dir,
        hooks=(first if not is_chief else []) + per_worker + list(hooks),
        chief_only_hooks=(first if is_chief else []) + chief + list(chief_only_hooks),
        save_checkpoint_secs=None, save_checkpoint_steps=None, save_summaries_steps=None,
        save_summaries_secs=None, log_step_count_steps=None, **session_args)
