"""The builder: N forward/backward/apply passes chained in one graph.

``unroll`` builds the canonical single step once (``multistep.builder.step``: ``loss_fn``'s
forward pass, its update ops, the gradients, transforms and checks, the apply, the
``after_apply``), under ``name/step/``, and compiles it (``multistep.compiler.compile``): N copies,
each after the one before, or one copy as the body of a loop run N times. Step k reads
the weights step k-1 wrote and recomputes its loss and gradients from them:

    loss_k  = loss_fn(*inputs[k])          after apply_{k-1}
    grads_k = d loss_k / d var_list
    apply_k = optimizer.apply_gradients(grads_k)   after loss_k

Running ``train_op`` once performs N real descent steps. The step is checked at build
time: a loss that uses a value built outside ``loss_fn`` from trained state raises
``StaleForwardError``.
"""

import contextlib
import dataclasses
import re
import time
import types
import warnings
import weakref

import tensorflow as tf

from multistep.builder import auto
from multistep.builder import checks
from multistep import graph as graph_lib
from multistep.compiler import streams as streams_lib
from multistep.compiler import xla as xla_lib
from multistep.builder import lint
from multistep.compiler.compile import (GraphTooLargeError, build, check_graph_size,
                                        make_run_length, positive_int, set_steps_per_run)
from multistep.compiler.runs import (PLAIN_SESSIONS, InputExhaustedError, StepFailedError,
                                     callable_for, exhausted_message)
from multistep.builder import phases as phases_lib
from multistep.builder import step as step_lib
from multistep.builder.checks import RECORDS
from multistep.choices import MODES
from multistep.builder.inputs import Inputs

__all__ = ["GraphTooLargeError", "InputExhaustedError", "MODES", "NONFINITE", "RECORDS",
           "Unrolled", "unroll"]


@dataclasses.dataclass(frozen=True)
class Unrolled:
    """The N-step program: run ``train_op`` once for N steps.

    Attributes:
      train_op: the last inner step's apply; running it runs all N steps
        (loop mode: ``steps_per_run`` steps).
      losses: float32 ``[N]`` (loop mode: ``[steps_per_run]``, static shape
        ``[None]``), the loss of each inner step before its apply.
        It depends on ``train_op``: fetching it (alone or with ``train_op``)
        runs the steps exactly once.
      records: name -> float32 ``[N]`` for each quantity asked for with
        ``record=`` (``"grad_norm"``, ``"learning_rate"``), like ``losses``.
      steps: N, the steps of one run (loop mode: the most of one run).
      var_list: the variables trained, in order.
      name: the name scope holding ``step_1`` ... ``step_N``.
      global_step: the global step variable, or None.
      skipped_steps: with ``nonfinite="skip"``, an int64 local variable counting the
        steps skipped for non-finite values since ``local_variables_initializer()`` ran
        (a checkpoint does not hold it, so one written by single steps restores; a
        session that did not initialise it starts counting at the first skip); else None.
      steps_per_run: loop mode (``mode="while_loop"``, with or without XLA): a scalar
        int32 tensor, the number of steps the next runs make, ``1..steps``: ``steps``
        in a new session, until ``set_steps_per_run`` sets it (a one-entry hash table
        of the session: no initialiser, no checkpoint, no variable reset touches it).
        Unrolled mode: None (the graph holds exactly ``steps`` copies of the step).
      mode: what was built: ``"unrolled"``, ``"while_loop"``, ``"unrolled+xla"`` or
        ``"while_loop+xla"`` (with ``mode="auto"``, what it chose).
      carry: with ``carry=``, what the run's last step carried out (fetch it with the
        train op; feed it as the next run's initial carry); else None.
      carry_in: with ``carry=``, the nest it was given (what the next run's first step
        starts from: ``ms.verify`` feeds it what the previous run carried out); else None.
      summaries: string ``[N]``: each inner step's ``tf.summary`` ops that ``loss_fn``
        built, merged (a serialized ``Summary`` a step; ``ms.hooks.StepSummaryHook``
        writes each at its step's global step); None if it built none.
      why: with ``mode="auto"``, how it chose: each mode's measured µs a run, and why
        it did not time the others (an op without an XLA kernel, ref variables, ...);
        else None.
    """

    train_op: tf.Operation
    losses: tf.Tensor
    steps: int
    var_list: tuple
    name: str
    records: dict = dataclasses.field(default_factory=dict)
    global_step: object = None
    skipped_steps: object = None
    steps_per_run: object = None
    mode: str = "unrolled"
    why: object = None
    _run_length: object = dataclasses.field(default=None, repr=False)  # _RunLength, loop mode
    summaries: object = None
    carry: object = None
    carry_in: object = None
    _batches_first: bool = dataclasses.field(default=False, repr=False)  # a run's batches taken first
    _kept_losses: object = dataclasses.field(default=None, repr=False)  # loop mode over an iterator
    _halt_losses: object = dataclasses.field(default=None, repr=False)  # XLA, nonfinite="raise"
    _callables: object = dataclasses.field(default_factory=weakref.WeakKeyDictionary,
                                           repr=False, compare=False)  # session -> callable

    def run(self, session, feed_dict=None):
        """Runs the steps once; returns their losses (numpy ``[N]``, loop mode ``[steps_per_run]``).

        Without a feed, on a ``tf.compat.v1.Session``, it calls a callable made once
        per session (``Session.make_callable``: the same fetch, without ``sess.run``'s
        per-call argument handling; with a feed, ``make_callable`` would call
        ``sess.run`` itself). Otherwise ``session.run`` (a ``MonitoredSession``'s hooks
        must see each run).

        If a ``tf.data`` input runs out in the middle of the run, the steps
        before stay applied and ``InputExhaustedError`` says how many (in loop mode,
        ``error.values`` holds their losses). In a ``MonitoredSession`` the error is
        TensorFlow's, unchanged (it ends training cleanly on an ``OutOfRangeError``).
        """
        try:
            if feed_dict or not isinstance(session, PLAIN_SESSIONS):
                return session.run(self.losses, feed_dict)
            call, new = callable_for(self._callables, session, self.losses)
            if new and self.mode == "unrolled+xla" and self.steps > UNROLLED_XLA_WARN_STEPS:
                return self._first_compiled_run(call)
            return call()
        except tf.errors.OutOfRangeError as error:
            if not isinstance(session, PLAIN_SESSIONS):
                raise
            losses = None
            if self._kept_losses is not None:
                applied, kept = session.run([self._run_length.done, self._kept_losses])
                losses = kept[:applied]
            raise InputExhaustedError(exhausted_message(self, session, error), error,
                                      losses) from error
        except tf.errors.InvalidArgumentError as error:
            named = (_nonfinite_named(self.name, error)
                     or step_lib.halt_message(self.name, self.var_list, error.message))
            if named is None:
                raise
            halted = re.match(rf"{re.escape(self.name)}: inner step (\d+) ", named)
            if self._halt_losses is None or halted is None:
                raise type(error)(error.node_def, error.op, named) from error
            losses = session.run(self._halt_losses)[:int(halted.group(1)) - 1]
            raise StepFailedError(named + " (their losses: this error's .values)", error,
                                  losses) from error

    def _first_compiled_run(self, call):
        """The first run of many unrolled XLA steps, timed: its compile grows with N."""
        started = time.perf_counter()
        losses = call()
        seconds = time.perf_counter() - started
        warnings.warn(
            f"{self.name}: the first run of {self.steps} unrolled XLA steps took {seconds:.1f} s "
            f"({seconds / self.steps * 1e3:.0f} ms a step), most of it XLA compiling "
            f"{self.steps} copies of the step. mode='while_loop' with xla=True (or "
            f"mode='auto') compiles one loop body whatever N, with the same results.",
            RuntimeWarning, stacklevel=3)
        return losses

    def set_steps_per_run(self, session, n):
        """From the next run on, a run makes ``n`` steps (``1 <= n <= steps``); loop mode only.

        No rebuild and no new op: it runs an assign op built by ``ms.unroll``, so
        it works on a finalized graph (MonitoredTrainingSession) and through a
        ``MonitoredSession`` as well as a plain ``Session``. ``losses`` and
        ``records`` then hold ``n`` values. The value lives in the session (a one-entry
        table, in no checkpoint, untouched by a variable reset): a new session starts
        again from ``steps``.
        """
        set_steps_per_run(self, session, n)



NONFINITE = ("raise", "skip", "ignore")
UPDATE_OPS = (True, False, "all")
GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP
SLOW_BUILD_SECONDS = 10.0  # an unrolled build that takes longer gets a warning
UNROLLED_XLA_WARN_STEPS = 32  # past this N, Unrolled.run reports unrolled XLA's compile time


# In a strategy's call_for_each_replica, AutoGraph converts the function it runs and
# what that calls; the builder is plain Python over graph ops, and runs as written.
@tf.autograph.experimental.do_not_convert
def unroll(loss_fn, optimizer=None, steps=None, *, var_list=None, inputs=None, grad_transforms=(),
           global_step=None, update_ops=True, after_apply=None, mode="unrolled", xla=False,
           record=(), nonfinite="raise", gate_gradients=GATE_OP, aggregation_method=None,
           colocate_gradients_with_ops=False, grad_loss=None, phases="chained", carry=None,
           name="multistep"):
    """Builds one op that performs ``steps`` real descent steps.

    Args:
      loss_fn: callable ``(*step_inputs) -> scalar float loss``. Called once, to build
        the single step that every inner step runs, so it must build the forward pass
        (not reuse a tensor built outside from the weights). Or a list of ``ms.phase(loss_fn,
        optimizer, var_list=...)``: several phases per inner step (a GAN's
        discriminator and generator), run in order (``phases``); ``optimizer`` and
        ``var_list`` stay unset, each phase has its own; ``losses`` is the last
        phase's, ``records["loss/<phase name>"]`` each phase's; the last phase
        advances ``global_step``; ``after_apply`` runs after the last phase. Not with
        XLA, ``mode="auto"``, ``record``, ``nonfinite="skip"`` or a strategy.
      optimizer: a ``tf.compat.v1.train.Optimizer``; one set of slots serves all
        steps. A callable learning rate is re-evaluated at every inner step.
      steps: N >= 1: the steps of one run; in loop mode the most a run makes
        (``Unrolled.set_steps_per_run`` sets fewer without a rebuild).
      var_list: variables to train; default: the trainable variables the loss
        has a gradient for. Each must have a gradient path from the loss.
      inputs: optional per-step data. Tensors, or a tuple/list of tensors or
        nests, each with leading dimension N: step k calls ``loss_fn(*slice_k)``
        (a lone tensor or dict is passed as one argument). Or a
        ``tf.compat.v1.data`` iterator or dataset: each step takes the next
        element (a tuple element is spread over the arguments).
      grad_transforms: gradient transforms ``(grads_and_vars, step) -> grads_and_vars``
        (``ms.clip_by_norm(1.0)``, ...) applied in order between compute and apply
        at every inner step, to the gradients as ``compute_gradients`` returns them
        (repeated sparse rows unsummed: ``multistep``'s transforms sum them first, one
        you write sees what it sees in a single step); ``step`` is the global step
        before the update (None without ``global_step``).
      global_step: optional integer variable, advanced once per inner step.
      update_ops: ``True``: the ops that ``loss_fn`` adds to
        ``tf.compat.v1.GraphKeys.UPDATE_OPS`` while building step k (batch
        normalization's moving mean and variance) run in step k, after its
        forward pass and before its gradients and apply, as a single step's
        ``with tf.control_dependencies(UPDATE_OPS): minimize(loss)`` runs them.
        The collection keeps the single step's (the ops a single-step graph of the
        same model holds). ``"all"``: those, and every
        other variable write that ``loss_fn`` builds (what Keras 3 layers such
        as ``BatchNormalization`` and ``Dropout`` need in graph mode: they write
        their state without UPDATE_OPS; ``tf.function`` would run the writes).
        ``False``: the update ops are left out and never run.
      after_apply: optional callable ``() -> op, tensor, list of them, or None``,
        called once, after the single step's apply and inside its dependencies; what
        it returns runs in every step before step k+1 reads anything: the single-step
        ``with tf.control_dependencies([train_op]): after_apply()``. For
        ``ema.apply(var_list)``, weight projections and constraints. The variables it
        creates (an EMA's shadows) get the names of a single-step graph. With
        ``nonfinite="skip"`` a skipped step runs no ``after_apply``.
      mode: ``"unrolled"``: N copies of the step, chained by control
        dependencies (the graph grows with N; each copy of a stateful random op
        restarts its stream: a warning says so). ``"while_loop"``: one
        ``tf.while_loop`` body run N times (graph size independent of N; one kernel of a
        stateful random op draws the single steps' stream; ref variables need v1
        control flow).
        ``"auto"``: the same program on every build, measured among modes that give the
        same bits: ``"while_loop"`` (the default) unless ``"unrolled"`` (N up to 64, no
        stateful random op) runs 1.25× faster or more, each built in a scratch copy of
        the graph and timed in a scratch session, in interleaved rounds paired round by
        round (about 1 to 3 s; ``loss_fn`` is called once). With ``xla=True``: XLA's
        loop, untimed (XLA is a change of rounding the user asks for, never chosen for
        them). ``Unrolled.mode`` says which; ``Unrolled.why`` gives the figures and why a
        mode was not timed. Over a ``tf.data`` iterator or in a replica context nothing
        is timed: ``"unrolled"``.
      xla: compile all N steps into one XLA program (``tf.function(jit_compile=True)``
        called from the graph; the single step is built in an XLA context). Bitwise
        equal to N runs of the single-step XLA program (``steps=1, xla=True``;
        ``ms.verify(..., xla=True)`` checks it); against plain single steps
        within floating-point tolerance, not bitwise: XLA fuses and reorders the
        arithmetic. XLA compiles CheckNumerics
        to nothing, so there ``nonfinite="raise"`` halts the program at the first
        non-finite step (it and the steps after it apply nothing) and an ``Assert``
        after the program raises ``InvalidArgumentError`` naming the step; UPDATE_OPS
        that ``loss_fn`` adds stay in the program, not in the graph's collection.
      record: per-step quantities to return beside the losses, in
        ``Unrolled.records``: ``"grad_norm"`` (global L2 norm of the gradients
        that are applied, after the transforms) and ``"learning_rate"`` (the
        optimizer's learning rate at that step; read from its ``_learning_rate``
        or ``_lr`` attribute, as the stock optimizers keep it).
      nonfinite: what a step whose loss or (processed) gradients are not finite
        does. ``"raise"``: the run stops there with an error naming the step and
        the variables; that step is not applied, earlier steps stay applied.
        ``"skip"``: that step changes no weight and no slot, the global step
        still advances, and ``Unrolled.skipped_steps`` counts it (resource
        variables only). ``"ignore"``: apply it anyway.
      gate_gradients: ``minimize``'s own option, passed to
        ``optimizer.compute_gradients`` at every step (the stale-forward check
        still applies). Set to anything but its default, every step takes its
        gradients with ``compute_gradients``, which walks all earlier steps: the
        build then grows as N^2 in unrolled mode.
      aggregation_method: likewise.
      colocate_gradients_with_ops: likewise.
      grad_loss: likewise.
      phases: with several phases, ``"chained"``: each phase reads the variables after
        the previous phase's apply (the single step that builds ``g_train`` under
        ``control_dependencies([d_train])``); ``"simultaneous"``: every phase's loss
        and gradients read the variables as the step found them, then every phase
        applies (the single step that applies both under ``control_dependencies``
        of both gradients).
      carry: state carried from each inner step into the next (an RNN's final state into
        the next step's initial state): a nest of tensors, the first step's value each
        run (a placeholder fed the state the last run left, as a PTB script feeds it).
        ``loss_fn(*step_inputs, carry)`` then returns ``(loss, next_carry)`` of the same
        structure; the carry comes in through ``tf.stop_gradient`` (the value a single
        step is fed, not a path back into earlier steps), and ``Unrolled.carry`` is the
        last step's next carry: fetch it with the train op and feed it to the next run.
        Not with several phases or under a strategy.
      name: name scope; steps appear as
        ``name/step_k/{forward,gradients,transform,apply,after_apply}`` (loop mode:
        ``name/loop/body/step/...``); the single step they copy is ``name/step/...``,
        which no run runs.

    A stateful op that ``loss_fn`` or ``after_apply`` builds and that nothing in
    its step depends on (an unused ``assign_add``) would never run: that is a
    ``ValueError`` naming the op. Every variable a step writes (weights, slots,
    global step, moving statistics, anything ``loss_fn`` or ``after_apply``
    assigns) is watched by the stale-forward check.

    In the replica context of a ``tf.compat.v1.distribute`` strategy (inside
    ``strategy.extended.call_for_each_replica(fn)``; ``ms.distribute.unroll`` does this
    for every replica) it builds that replica's single step, whose apply all-reduces the
    gradients through the optimizer's own ``merge_call``; one more ``merge_call`` then
    compiles the steps of all the replicas together (unrolled or as one loop body), step
    k+1 of every replica after step k of all of them. ``grad_transforms`` then see this
    replica's local gradient, before the all-reduce (as in a single distributed step
    that clips before ``apply_gradients``); ``losses`` are this replica's. Not with XLA
    or ``nonfinite="skip"``: a ``merge_call`` cannot run inside a function or cond body.

    Returns:
      An ``Unrolled`` with ``train_op`` and ``losses``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     w = tf.Variable(1.0)
      ...     sgd = tf.compat.v1.train.GradientDescentOptimizer(0.25)
      ...     u = ms.unroll(lambda: w * w, sgd, 3)
      ...     with tf.compat.v1.Session() as sess:
      ...         sess.run(tf.compat.v1.global_variables_initializer())
      ...         print(sess.run(u.losses), sess.run(w))
      [1.       0.25     0.0625] 0.125
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "ms.unroll builds a tf.compat.v1 graph; call it inside "
            "`with tf.Graph().as_default():` or after "
            "tf.compat.v1.disable_eager_execution().")
    steps = positive_int("steps", steps)
    if not isinstance(xla, bool):
        raise TypeError(f"xla must be True or False, got {xla!r}.")
    if _FORCED_XLA:  # ms.verify(..., xla=True): before the checks that read xla
        xla = _FORCED_XLA[-1]
    if _FORCED_MODE:  # multistep bench FILE.py:FN, each mode in turn
        mode = _FORCED_MODE[-1]
    phased = phases_lib.parse(loss_fn, optimizer, var_list, phases)
    for one in ([(loss_fn, optimizer)] if phased is None
                else [(p.loss_fn, p.optimizer) for p in phased[0]]):
        checks.check_loss_fn(one[0])
        checks.check_optimizer(one[1])
    if phased is not None:
        optimizer = phased[0][-1].optimizer  # for the checks below
        if (xla or mode == "auto" or record or nonfinite == "skip" or carry is not None
                or step_lib.in_replica_context()):
            raise ValueError(
                "several phases build with mode='unrolled' or 'while_loop', without XLA, "
                "record, nonfinite='skip', carry or a strategy (not yet supported there).")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}.")
    if update_ops not in UPDATE_OPS or not isinstance(update_ops, (bool, str)):
        raise ValueError(f"update_ops must be one of {UPDATE_OPS}, got {update_ops!r}.")
    if after_apply is not None and not callable(after_apply):
        raise TypeError(f"after_apply must be a callable () -> ops, got {after_apply!r}.")
    checks.check_replica_context(optimizer, mode, xla, nonfinite)
    gradient_options = {}  # minimize's options that differ from their defaults
    if gate_gradients != GATE_OP:
        gradient_options["gate_gradients"] = gate_gradients
    if aggregation_method is not None:
        gradient_options["aggregation_method"] = aggregation_method
    if colocate_gradients_with_ops:
        gradient_options["colocate_gradients_with_ops"] = True
    if grad_loss is not None:
        gradient_options["grad_loss"] = grad_loss
    guard = step_lib.CreationGuard(tf.compat.v1.get_default_graph())
    transform = checks.check_transforms(grad_transforms)
    global_step = checks.check_global_step(global_step)
    if phased is None:
        step = step_lib.Step(
            loss_fn, optimizer, checks.check_var_list(var_list), global_step, transform, guard,
            checks.check_record(record, optimizer), nonfinite, update_ops=update_ops,
            after_apply=after_apply, gradient_options=gradient_options)
    else:
        items, names = phased
        step = phases_lib.Phased([step_lib.Step(
            p.loss_fn, p.optimizer,
            p.var_list if callable(p.var_list) else checks.check_var_list(p.var_list),
            global_step if p is items[-1] else None, transform, guard, (), nonfinite,
            update_ops=update_ops, after_apply=after_apply if p is items[-1] else None,
            gradient_options=dict(gradient_options)) for p in items], names, phases)
    if carry is not None:
        if step_lib.in_replica_context():
            raise ValueError("carry= is not supported under a tf.distribute strategy.")
        leaves = tf.nest.flatten(carry)
        if any(leaf is None for leaf in leaves):
            raise ValueError(
                f"carry= holds None (item {[leaf is None for leaf in leaves].index(True)} "
                f"flattened): it takes the first step's state, a tensor at every leaf (a "
                f"placeholder fed what the previous run's Unrolled.carry gave).")
        step.initial_carry = tf.nest.map_structure(tf.convert_to_tensor, carry)
    graph = tf.compat.v1.get_default_graph()
    first_op = len(graph.get_operations())
    with tf.name_scope(name) as scope, tf.compat.v1.variable_creator_scope(step.guard):
        label = step.label = scope.rstrip("/")
        if update_ops is not False:
            step_lib.warn_outside_updates(graph, label)
        if nonfinite == "skip":
            # Local, as steps_per_run: no checkpoint holds it, so a single step's restores.
            step.skipped = tf.compat.v1.Variable(
                0, dtype=tf.int64, trainable=False, use_resource=True, name="skipped_steps",
                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        feed = Inputs(inputs, steps, xla=xla)
        why, timed = None, False
        if mode == "auto" and _FORCED_XLA:  # ms.verify(..., xla=True): compiled, in a loop
            mode = "while_loop"
        elif mode == "auto" and xla:  # XLA asked for: its loop (unrolled XLA steps are
            mode = "while_loop"         # not bitwise those of the step compiled alone)
            why = "xla=True: the XLA loop, bitwise N runs of the step compiled alone"
        elif mode == "auto":
            why = auto.untimed(feed, in_replica_context=step_lib.in_replica_context())
            timed = why is None  # the plain step's two modes, timed
            mode = "while_loop" if timed else "unrolled"
        run_length = (make_run_length(steps, count_done=feed.iterator is not None)
                      if mode == "while_loop" else None)
        feed.check_lengths(steps, run_length.read if run_length is not None else None)
        # XLA compiles CheckNumerics to nothing: halt instead, and raise after the program
        step.halts = xla and nonfinite == "raise"
        step.xla, step.looped = xla, mode == "while_loop"
        before = set(graph.get_operations())
        started = time.perf_counter()
        # Under XLA the step is built in an XLA context, as a compiled function's body is:
        # its conds and loops then stay functional, and their gradients compile.
        with tf.name_scope("step") as prefix, _xla_context(xla):
            step.guard.step_prefix = prefix
            args, given = feed.template()
            carry_in = None if not step.carries else tf.nest.map_structure(
                lambda t: tf.compat.v1.placeholder(t.dtype, t.shape, name="carry_in"),
                step.initial_carry)
            outputs, end = step.build(args, carry_in)
            halt = step.halt  # (XLA, nonfinite="raise": the halt state; else None)
        step_seconds = time.perf_counter() - started
        watched = {**graph_lib.watched_variables(step.state()), **step.written}
        carry_links = {} if carry_in is None else {
            placeholder: (first, following) for placeholder, first, following in zip(
                tf.nest.flatten(carry_in), tf.nest.flatten(step.initial_carry),
                tf.nest.flatten(step.next_carry))}

        halted = {}  # XLA, nonfinite="raise": {"losses": the variable a run keeps them in}

        def program(mode, xla, form, find=lambda x: x, run_length=None):
            """(the outputs' keys, ``_compiled`` of ``form``, (outputs, end, halt), in
            ``mode``); ``find``: a tensor's copy in the graph it is built in (auto's
            trials)."""
            outputs, end, halt = form
            links = {find(p): (find(first), find(following))
                     for p, (first, following) in carry_links.items()}
            looped = halt is not None and halt["looped"]
            if halt is not None:  # the halt state, carried as carry= is: the last links
                links.update(zip(map(find, halt["in"]), zip(
                    [tf.constant(0)] if looped else [tf.constant(True), tf.constant([0, 0, 0])],
                    map(find, halt["out"]))))

            def finish(end, carried, fetched):  # after an XLA program: raise if a step
                made = None if not looped else (  # halted it (the loop's steps: its first
                    end.outputs[0] if mode == "while_loop" and steps > 1 else tf.constant([1]))
                losses = fetched[keys.index("loss")]  # (all entries: chunks of CHUNK steps)
                with tf.control_dependencies(None):  # (never initialised: each run sets it)
                    kept = tf.compat.v1.Variable(tf.zeros(losses.shape, losses.dtype),
                                                 trainable=False, use_resource=True,
                                                 collections=[], name="halt_losses")
                halted["losses"] = kept  # (the losses of the steps a halted run applied)
                with tf.control_dependencies([end]):
                    keep = kept.assign(losses, read_value=False)
                with tf.control_dependencies([end, keep]):
                    return step_lib.raise_if_halted(carried[-len(halt["in"]):], step.var_list,
                                                    label, made)
            if mode == "while_loop" and run_length is None:
                run_length = make_run_length(steps, count_done=feed.iterator is not None)
            keys = list(outputs)
            # One step: the step itself, whatever the mode (the single step that ms.verify
            # compares each step of a loop with).
            return keys, _compiled(
                step_lib.in_replica_context(), [find(outputs[key]) for key in keys] + [find(end)],
                steps, label, mode if steps > 1 else "unrolled",
                given={find(p): find(t) for p, t in given.items()}, links=links,
                run_length=run_length, done=run_length.done if run_length is not None else None,
                xla=xla, strip=[(prefix, label)], finish=finish if halt is not None else None,
                stop=find(halt["in"][0]) if looped else None)

        if step_lib.in_replica_context():  # the replicas' steps, built in turns, are one step
            base = re.sub(r"^replica_\d+/", "", label) + "/step/"
            before = {op for op in before
                      if not re.sub(r"^replica_\d+/", "", op.name).startswith(base)}
        if timed:
            trial = time.perf_counter()
            mode, why = _timed(step, graph, (outputs, end, halt), steps, label, program)
            started += time.perf_counter() - trial  # (the slow-build warning: not the trial)
            run_length = run_length if mode == "while_loop" else None
        if steps > 1:
            lint.check_built_outside(end, before, watched, name=label, loop=mode == "while_loop")
        if xla and step.summarized:
            raise ValueError(
                f"{label}: loss_fn builds tf.summary ops, which XLA cannot compile (string "
                f"ops): build without xla=True (mode='auto' then builds unrolled steps), "
                f"or return the values with record= or through the loss.")
        if mode == "while_loop" and steps > 1:
            step_lib.check_capturable(step.state(), "mode='while_loop'", compiled=xla)
        if not isinstance(graph, tf.__internal__.FuncGraph):
            streams_lib.share(graph)  # (random ops no session holds: one stream each)
        if steps > 1 and (mode == "unrolled" or xla):  # (a loop body's one kernel draws
            lint.warn_stateful_random(end, name=label)  # the single steps' stream)
        if mode == "unrolled" and steps > 1:
            check_graph_size(graph, lambda op: op not in before, steps, label)
        keys, compiled = program(mode, xla, (outputs, end, halt), run_length=run_length)
        values = dict(zip(keys, compiled.values))
        if mode == "unrolled" and steps > 1:
            _warn_slow_build(step_seconds, time.perf_counter() - started, steps, label)
        if xla:
            xla_lib.warn_random_under_xla(compiled.program, name=label)
        with tf.control_dependencies([compiled.train_op]):
            losses = tf.identity(values.pop("loss"), name="losses")
        train_op = compiled.train_op
    if not step_lib.in_replica_context():  # (there, the merge_call that compiles warns)
        _warn_racing(graph, graph.get_operations()[first_op:], label)
    return Unrolled(train_op=train_op, losses=losses, steps=steps,
                    summaries=values.pop("summary", None),
                    carry=(tf.nest.pack_sequence_as(step.initial_carry,
                                                    compiled.carried[:len(carry_links)])
                           if step.carries else None),
                    carry_in=step.initial_carry if step.carries else None,
                    var_list=tuple(step.var_list), name=label, records=values,
                    global_step=step.global_step, skipped_steps=step.skipped,
                    steps_per_run=run_length.read if run_length else None,
                    mode=mode + ("+xla" if xla else ""), why=why, _run_length=run_length,
                    _kept_losses=(getattr(compiled, "partial", None) or {}).get(keys.index("loss")),
                    _halt_losses=halted.get("losses"))


def _timed(step, graph, form, steps, label, program):
    """``mode="auto"`` without XLA: (mode, why) of the faster of the plain step's two
    programs (``auto.choose``), loop mode and unrolled steps, which give the same bits.
    Unrolled is not a candidate past ``auto.MOST_UNROLLED_STEPS`` or over stateful random
    ops (each copy would restart the stream: other bits)."""
    refused = {}
    random_ops = graph_lib.stateful_random_ops(graph_lib.ancestors_postorder(form[1]))
    if steps > auto.MOST_UNROLLED_STEPS:
        refused["unrolled"] = f"N > {auto.MOST_UNROLLED_STEPS}: N copies to build"
    elif random_ops:
        refused["unrolled"] = (f"stateful random ops ({graph_lib.named_few(random_ops)}): "
                               f"each copy would restart the stream")
    if refused:  # one candidate: nothing to time
        return "while_loop", "".join(f"not timed: {name} ({why})"
                                     for name, why in refused.items())
    created = len(step.guard.created)

    def build(name, find):
        if name == "while_loop" and steps > 1:
            step_lib.check_capturable(step.state(), "mode='while_loop'", compiled=False)
        with tf.compat.v1.name_scope(label + "/"):
            keys, compiled = program(name, False, form, find)
        return compiled.values[keys.index("loss")]

    try:
        return auto.choose(graph, ["while_loop", "unrolled"], build, label, steps)
    finally:
        del step.guard.created[created:]  # (the trials' variables, in their own graphs)


def _compiled(replicated, roots, steps, label, mode, *, given, strip, **options):
    """``compile.build`` of the single step's ``roots``. In a ``tf.distribute`` replica
    context every replica has built its step (its apply all-reduces through a
    ``merge_call``): one ``merge_call`` then compiles the steps of every replica together,
    step k+1 of each after step k of all, and gives each replica its own values."""
    if not replicated:
        return build(roots, steps, label, mode, feeds=(), given=given, strip=strip,
                     random="warn", **options)
    def merge(strategy, *per_replica):
        roots, pairs, prefix, label = [
            tf.nest.map_structure(strategy.experimental_local_results, x) for x in per_replica]
        replicas = len(prefix)
        flat = [root[r] for r in range(replicas) for root in roots]
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        built = build(flat, steps, label[0], mode, feeds=(), random="warn",
                      given={p[r]: t[r] for p, t in pairs for r in range(replicas)},
                      strip=[(prefix[r], label[r]) for r in range(replicas)], **options)
        _warn_racing(graph, graph.get_operations()[first_op:], label[0])
        mine = [built.values[r * len(roots):(r + 1) * len(roots)] for r in range(replicas)]
        # (merge runs once, in one replica's thread: each gets its values, and what build
        # made, out of the structure the strategy splits into replicas)
        return ([_per_replica([mine[r][j] for r in range(replicas)]) for j in range(len(roots))],
                types.SimpleNamespace(built=built))

    [(prefix, own)] = strip
    values, made = tf.distribute.get_replica_context().merge_call(
        merge, args=(roots, list(given.items()), prefix, own))
    return made.built._replace(values=values)


def _per_replica(values):
    from tensorflow.python.distribute import (
        values as values_lib,  # PerReplica: no public constructor
    )

    return values_lib.PerReplica(tuple(values))


def _warn_racing(graph, ops, label):
    """Warn when this build writes state an earlier ``ms.unroll`` in the graph reads or
    writes, or reads state it writes: fetched in one ``sess.run``, the two would be two
    chains of steps that nothing orders against each other."""
    read = {source for op in ops for source in map(graph_lib.source_op, op.inputs)
            if source.type in ("VarHandleOp", "VariableV2")}
    written = set(graph_lib.written_variables(ops))
    # (label, variables written, variables read) of each ms.unroll built in the graph,
    # kept on it (a module-level map from graphs to their ops would keep them alive).
    if not hasattr(graph, "_multistep_builds"):
        graph._multistep_builds = []
    built = graph._multistep_builds
    for other, other_written, other_read in built:
        shared = (written & (other_written | other_read)) | (read & other_written)
        if shared:
            names = ", ".join(sorted(f"'{op.name}'" for op in shared)[:4])
            warnings.warn(
                f"{label} and {other} (built before it in this graph) touch the same state, "
                f"one writing what the other reads or writes ({names}). Fetched in one "
                f"sess.run, their train ops are two chains of steps that nothing orders "
                f"against each other: which step reads which weights would change from run to "
                f"run. Run them in separate sess.run calls, or build one ms.unroll with a "
                f"phase each: ms.unroll([ms.phase(d_loss, d_opt, var_list=D), "
                f"ms.phase(g_loss, g_opt, var_list=G)], steps=N).",
                RuntimeWarning, stacklevel=graph_lib.user_stacklevel())
            break
    built.append((label, written, read))


def _xla_context(xla):
    from tensorflow.python.eager.polymorphic_function import (
        polymorphic_function,  # the context tf.function(jit_compile=True) traces in
    )

    return polymorphic_function.OptionalXlaContext(xla)


def _nonfinite_named(label, error):
    """A non-finite check's message with the step it failed in named (its op is in the
    copy ``<label>/step_k/``), or None for another error."""
    failed = getattr(error.op, "name", None) or error.message
    where = re.search(rf"{re.escape(label)}/step_(\d+)/", failed)
    if where is None or f"{step_lib.NONFINITE_STEP} has a non-finite" not in error.message:
        return None
    return error.message.replace(step_lib.NONFINITE_STEP, f"inner step {where.group(1)}", 1)


_FORCED_XLA = []  # forced_xla's stack: the last value overrides every ms.unroll's xla=


@contextlib.contextmanager
def forced_xla(xla):
    """Within it, every ``ms.unroll`` builds with ``xla=xla`` whatever it is given: how
    ``ms.verify(..., xla=True)`` builds a user's ``build_fn`` as compiled fused steps,
    compiled single steps, and plain single steps."""
    _FORCED_XLA.append(bool(xla))
    try:
        yield
    finally:
        _FORCED_XLA.pop()


_FORCED_MODE = []  # forced_mode's stack: the last value overrides every ms.unroll's mode=


@contextlib.contextmanager
def forced_mode(mode):
    """Within it, every ``ms.unroll`` builds with ``mode=mode`` whatever it is given:
    how ``multistep bench FILE.py:FN`` times a user's ``build_fn`` in each mode."""
    _FORCED_MODE.append(mode)
    try:
        yield
    finally:
        _FORCED_MODE.pop()


def _warn_slow_build(step_seconds, seconds, steps, label):
    """Warn when building ``steps`` unrolled copies took longer than ``SLOW_BUILD_SECONDS``
    (``step_seconds``: the single step's build, which loop mode needs alone)."""
    if seconds > SLOW_BUILD_SECONDS:
        warnings.warn(
            f"{label}: {steps} unrolled steps took {seconds:.1f} s to build (the single step "
            f"{step_seconds * 1e3:.0f} ms); the graph of {steps} copies will take about {steps} "
            f"times a step's memory, and its first run longer (Grappler optimises every "
            f"copy). mode='while_loop' builds the step once and one loop body whatever N, "
            f"about {step_seconds:.1f} s here, with the same results.",
            RuntimeWarning, stacklevel=graph_lib.user_stacklevel())
