"""The builder: N forward/backward/apply passes chained in one graph.

Inner step k calls ``loss_fn`` inside ``tf.control_dependencies([apply_{k-1}])``,
so its forward pass reads the weights that step k-1 wrote, then computes
gradients and applies them with the user's ``tf.compat.v1.train.Optimizer``:

    loss_k  = loss_fn(*inputs[k])          after apply_{k-1}
    grads_k = d loss_k / d var_list
    apply_k = optimizer.apply_gradients(grads_k)   after loss_k

Running ``train_op`` once performs N real descent steps. The graph is checked at
build time: a step that reads trained state outside its dependencies raises
``StaleForwardError``.
"""

import collections
import contextlib
import dataclasses
import numbers
import re
import time
import warnings
import weakref

import tensorflow as tf

from multistep import auto, lint, transforms
from multistep import phases as phases_lib
from multistep import step as step_lib
from multistep.inputs import Inputs
from multistep.choices import MODES

__all__ = ["GraphTooLargeError", "InputExhaustedError", "MODES", "NONFINITE", "RECORDS", "Unrolled",
           "unroll"]


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
      steps_per_run: loop mode (``mode="while_loop"``, with or without XLA): the
        local int32 variable (``LOCAL_VARIABLES``, so never in a checkpoint)
        whose value is the number of steps the next runs make, ``1..steps``;
        its initial value is ``steps``. Set it with ``set_steps_per_run``.
        ``local_variables_initializer`` (which MonitoredTrainingSession runs)
        initialises it; until then the loop makes ``steps`` steps. Unrolled
        mode: None (the graph holds exactly ``steps`` copies of the step).
      mode: what was built: ``"unrolled"``, ``"while_loop"``, ``"unrolled+xla"`` or
        ``"while_loop+xla"`` (with ``mode="auto"``, what it chose).
      carry: with ``carry=``, what the run's last step carried out (fetch it with the
        train op; feed it as the next run's initial carry); else None.
      carry_in: with ``carry=``, the nest it was given (what the next run's first step
        starts from: ``ms.verify`` feeds it what the previous run carried out); else None.
      summaries: string ``[N]``: each inner step's ``tf.summary`` ops that ``loss_fn``
        built, merged (a serialized ``Summary`` a step; ``ms.hooks.StepSummaryHook``
        writes each at its step's global step); None if it built none.
      why: with ``mode="auto"``, why it did not choose ``"while_loop+xla"`` (the op
        without an XLA kernel, the ref variables, ...); else None.
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
        before stay applied and ``InputExhaustedError`` says how many.
        """
        try:
            if feed_dict or not isinstance(session, _PLAIN_SESSIONS):
                return session.run(self.losses, feed_dict)
            call, new = callable_for(self._callables, session, self.losses)
            if new and self.mode == "unrolled+xla" and self.steps > UNROLLED_XLA_WARN_STEPS:
                return self._first_compiled_run(call)
            return call()
        except tf.errors.OutOfRangeError as error:
            raise InputExhaustedError(self._exhausted_message(session, error), error) from error

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
        ``records`` then hold ``n`` values. The value is a local variable: a new
        session starts again from ``steps``.
        """
        set_steps_per_run(self, session, n)

    def _exhausted_message(self, session, error):
        # The op that ran out; make_callable's errors name it only in their message.
        failed = getattr(error.op, "name", None) or error.message
        where = re.search(rf"{re.escape(self.name)}/step_(\d+)/", failed)
        length = self.steps if self._run_length is None else session.run(self._run_length.read)
        if where:
            applied = int(where.group(1)) - 1
        elif self._run_length is not None and self._run_length.done is not None:
            applied = session.run(self._run_length.done)  # the loop counts the steps it ended
        else:
            applied = None
        if self._batches_first:  # ms.distribute.unroll over an iterator
            done = (f"none of its {length} steps were applied: a run takes its {length} batches "
                    f"before its first step, fewer were left, and those it took are lost")
        elif applied is not None:
            done = f"the first {applied} of its {length} steps were applied"
        else:
            done = "the steps before the missing batch were applied"
        if self.global_step is not None:
            done += f"; the global step is now {session.run(self.global_step)}"
        return (f"{self.name}: the input ran out during a run: {done}. Re-initialise or "
                f"repeat the dataset, or make it a multiple of {length} batches long.")


_PLAIN_SESSIONS = (tf.compat.v1.Session, tf.compat.v1.InteractiveSession)


def callable_for(callables, session, fetches):
    """(the callable that runs ``fetches`` on ``session``, made now?): one
    ``Session.make_callable`` per session, kept in ``callables`` (a WeakKeyDictionary)."""
    if session in callables:
        return callables[session], False
    # A callable holds its session, so its weak key would never die: drop the callables of
    # closed sessions, which then free their resources.
    for closed in [s for s in callables if s._closed]:
        del callables[closed]
    callables[session] = session.make_callable(fetches)
    return callables[session], True


def set_steps_per_run(program, session, n):
    """``program.set_steps_per_run`` (an ``Unrolled`` or ``ms.compile``'s ``Compiled``):
    from the next run on, a run of loop mode makes ``n`` steps, ``1 <= n <= steps``."""
    if program._run_length is None:
        raise TypeError(
            f"{program.name}: set_steps_per_run needs mode='while_loop'; in mode='unrolled' "
            f"the graph holds exactly {program.steps} copies of the step, so every run makes "
            f"{program.steps} steps. Build with mode='while_loop' (graph size independent of "
            f"N) to vary the run length without a rebuild.")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{program.name}: steps per run must be an int, got {n!r} "
                        f"({type(n).__name__}).")
    if not 1 <= n <= program.steps:
        raise ValueError(
            f"{program.name}: steps per run must be in 1..{program.steps} (the most a run was "
            f"built for: steps={program.steps}), got {n}.")
    session.run(program._run_length.assign, {program._run_length.value: int(n)})


class InputExhaustedError(tf.errors.OutOfRangeError):
    """A ``tf.data`` input ran out in the middle of a fused run."""

    def __init__(self, message, error):
        super().__init__(error.node_def, error.op, message)


NONFINITE = ("raise", "skip", "ignore")
UPDATE_OPS = (True, False, "all")
GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP
SLOW_BUILD_SECONDS = 10.0  # an unrolled build predicted to take longer gets a warning
UNROLLED_XLA_WARN_STEPS = 32  # past this N, Unrolled.run reports unrolled XLA's compile time
RECORDS = ("grad_norm", "learning_rate")
GRAPHDEF_LIMIT = 2 ** 31  # bytes: protobuf's limit on a serialized GraphDef


class GraphTooLargeError(ValueError):
    """An unrolled graph would pass the 2 GB GraphDef limit."""


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
      loss_fn: callable ``(*step_inputs) -> scalar float loss``. Called once per
        inner step, so it must build the forward pass (not reuse a tensor built
        outside). Variables it creates on the first call (``get_variable``,
        Keras layers) are reused on later calls. Or a list of ``ms.phase(loss_fn,
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
        at every inner step, after ``ms.dedupe_sparse`` (a gradient they return
        unchanged reaches the optimizer unsummed, so transforms that do nothing leave
        the result bitwise as without them); ``step`` is the global step before the
        update (None without ``global_step``).
      global_step: optional integer variable, advanced once per inner step.
      update_ops: ``True``: the ops that ``loss_fn`` adds to
        ``tf.compat.v1.GraphKeys.UPDATE_OPS`` while building step k (batch
        normalization's moving mean and variance) run in step k, after its
        forward pass and before its gradients and apply, as a single step's
        ``with tf.control_dependencies(UPDATE_OPS): minimize(loss)`` runs them.
        The collection keeps step 1's (the ops a single-step graph of the same
        model holds), not those of steps 2..N. ``"all"``: those, and every
        other variable write that ``loss_fn`` builds (what Keras 3 layers such
        as ``BatchNormalization`` and ``Dropout`` need in graph mode: they write
        their state without UPDATE_OPS; ``tf.function`` would run the writes).
        ``False``: the update ops are left out and never run.
      after_apply: optional callable ``() -> op, tensor, list of them, or None``,
        called once per inner step after that step's apply and inside its
        dependencies; what it returns runs before step k+1 reads anything: the
        single-step ``with tf.control_dependencies([train_op]): after_apply()``.
        For ``ema.apply(var_list)``, weight projections and constraints. The
        variables it creates on its first call (an EMA's shadows) get the names
        of a single-step graph. With ``nonfinite="skip"`` a skipped step runs no
        ``after_apply``.
      mode: ``"unrolled"``: N copies of the step, chained by control
        dependencies (the graph grows with N). ``"while_loop"``: step 1, which
        creates the variables and slots, then one ``tf.while_loop`` body for
        steps 2..N (graph size independent of N; ref variables need v1 control flow).
        ``"auto"``: ``"while_loop"`` with XLA (``xla`` is then ignored) when step 1
        compiles under XLA, tried at build time; else ``"unrolled"`` without XLA, and
        ``Unrolled.why`` says why (an op without an XLA kernel, ref variables, a
        ``tf.data`` iterator input, a replica context). ``Unrolled.mode`` says which.
      xla: compile all N steps into one XLA program (``tf.function(jit_compile=True)``
        called from the graph; step 1 makes the variables and slots in the graph from
        inside it). Bitwise equal to N runs of the single-step XLA program (``steps=1,
        xla=True``; ``ms.verify(..., xla=True)`` checks it); against plain single steps
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
      gate_gradients, aggregation_method, colocate_gradients_with_ops, grad_loss:
        ``minimize``'s own options, passed to ``optimizer.compute_gradients`` at
        every step (the stale-forward check still applies). Set to anything
        but their defaults, every step takes its gradients with
        ``compute_gradients``, which walks all earlier steps: the build then
        grows as N^2 in unrolled mode.
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
        ``name/step_1/...`` and ``name/loop/body/...``).

    A stateful op that ``loss_fn`` or ``after_apply`` builds and that nothing in
    its step depends on (an unused ``assign_add``) would never run: that is a
    ``ValueError`` naming the op. Every variable a step writes (weights, slots,
    global step, moving statistics, anything ``loss_fn`` or ``after_apply``
    assigns) is watched by the stale-forward check.

    In the replica context of a ``tf.compat.v1.distribute`` strategy (inside
    ``strategy.extended.call_for_each_replica(fn)``; ``ms.distribute.unroll`` does this
    for every replica) it builds that replica's N steps: each step's apply all-reduces
    the gradients through the optimizer's own ``merge_call``, and step k+1 of every
    replica starts after step k of all of them. ``grad_transforms`` then see this
    replica's local gradient, before the all-reduce (as in a single distributed step
    that clips before ``apply_gradients``); ``losses`` are this replica's. Only
    ``mode="unrolled"`` without XLA and ``nonfinite`` ``"raise"`` or ``"ignore"``:
    a ``merge_call`` cannot run inside a loop, function or cond body.

    Returns:
      An ``Unrolled`` with ``train_op`` and ``losses``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     w = tf.Variable(1.0)
      ...     u = ms.unroll(lambda: w * w, tf.compat.v1.train.GradientDescentOptimizer(0.25), 3)
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
    phased = phases_lib.parse(loss_fn, optimizer, var_list, phases)
    for one in ([(loss_fn, optimizer)] if phased is None
                else [(p.loss_fn, p.optimizer) for p in phased[0]]):
        _check_loss_fn(one[0])
        _check_optimizer(one[1])
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
    _check_replica_context(optimizer, mode, xla, nonfinite)
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
    transform, global_step = _check_transforms(grad_transforms), _check_global_step(global_step)
    if phased is None:
        step = step_lib.Step(
            loss_fn, optimizer, _check_var_list(var_list), global_step, transform, guard,
            _check_record(record, optimizer), nonfinite, update_ops=update_ops,
            after_apply=after_apply, gradient_options=gradient_options)
    else:
        items, names = phased
        step = phases_lib.Phased([step_lib.Step(
            p.loss_fn, p.optimizer,
            p.var_list if callable(p.var_list) else _check_var_list(p.var_list),
            global_step if p is items[-1] else None, transform, guard, (), nonfinite,
            update_ops=update_ops, after_apply=after_apply if p is items[-1] else None,
            gradient_options=dict(gradient_options)) for p in items], names, phases)
    if carry is not None:
        if step_lib.in_replica_context():
            raise ValueError("carry= is not supported under a tf.distribute strategy.")
        if mode == "while_loop" and not xla and not tf.compat.v1.control_flow_v2_enabled():
            # A v1 loop variable whose first value step 1 computed from the weights: v1
            # tf.gradients in the body refuses to differentiate "through the initial value
            # of a loop variable", stop_gradient or not.
            raise ValueError(
                "carry= with mode='while_loop' needs v2 control flow (on unless "
                "tf.compat.v1.disable_v2_behavior() or disable_control_flow_v2() turned it "
                "off): under v1 control flow use mode='unrolled' (or xla=True, whose loop is a "
                "function's, v2).")
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
            step_lib.warn_outside_updates(tf.compat.v1.get_default_graph(), label)
        if nonfinite == "skip":
            # Local, as steps_per_run: no checkpoint holds it, so a single step's restores.
            step.skipped = tf.compat.v1.Variable(
                0, dtype=tf.int64, trainable=False, use_resource=True, name="skipped_steps",
                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        feed = Inputs(inputs, steps, xla=xla and mode != "auto")
        why = None
        if mode == "auto" and _FORCED_XLA:  # ms.verify(..., xla=True): compiled, in a loop
            mode = "while_loop"
        elif mode == "auto":
            mode, xla, why = auto.choose(step, feed, label,
                                         in_replica_context=step_lib.in_replica_context())
        run_length = (_run_length(steps, count_done=feed.iterator is not None)
                      if mode == "while_loop" else None)
        count = run_length.read if run_length is not None else None
        feed.check_lengths(steps, count)

        def steps_1_to_n(count):
            """Every step, in the current graph (XLA: the compiled program's): ({output
            name: [N] values}, the op that ends the last step)."""
            graph = tf.compat.v1.get_default_graph()
            first_op = len(graph.get_operations())
            started = time.perf_counter()
            with tf.name_scope("step_1"):
                first, end = step.build(1, feed.args(0), deps=[])
            carried = step.next_carry
            step_seconds = time.perf_counter() - started
            step_bytes = sum(op.node_def.ByteSize() for op in graph.get_operations()[first_op:])
            watched.update({**lint.watched_variables(step.state()), **step.written})
            lint.warn_stateful_random(end, name=label)
            if mode == "while_loop" and steps > 1:
                step_lib.check_capturable(step.state(), "mode='while_loop'", compiled=xla)
            if mode == "unrolled" and steps > 1:
                _check_graph_size(graph, step_bytes, steps, label)
            if steps == 1:
                later, last = {}, end
            elif mode == "while_loop":
                chunk = CHUNK if xla and steps - 1 > CHUNK else None
                later, last, carried = _loop(step, feed, steps, end, watched, label, count,
                                             run_length.done, chunk=chunk, carried=carried)
            else:
                later, last, carried = _chain(step, feed, steps, end, watched, label,
                                              step_seconds, carried)
            with tf.control_dependencies([last]):
                outputs = {key: tf.concat([first[key][None]] + ([later[key]] if later else []), 0,
                                          name="losses" if key == "loss" else key)
                           for key in first}
            if step.carries:
                outputs["carry"] = carried  # the last step's next carry
            return outputs, last

        watched = {}  # the trained state and every variable a step writes, from step 1
        if xla and nonfinite == "raise":  # XLA compiles CheckNumerics to nothing: halt instead
            step.halted = tf.compat.v1.Variable(
                [0, 0], dtype=tf.int32, trainable=False, use_resource=True, name="halted",
                collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        if xla:
            # All N steps in one compiled program; step 1 creates the variables and slots
            # there, lifted into this graph by the creation guard (init_scope).
            step_lib.ensure_variable_stores()
            step.guard.lift = True
            program = tf.function(lambda count: steps_1_to_n(count)[0], jit_compile=True,
                                  autograph=False)
            # The halt flag is reset here, before the program: reset inside it, the first run
            # after global_variables_initializer() found it uninitialised, the second set,
            # and XLA compiled the program once for each (two compiles of 1.8 and 1.6 s).
            reset = step.halted.assign([0, 0], read_value=False) if step.halted is not None else None
            try:
                with tf.control_dependencies([] if reset is None else [reset]):
                    outputs = program(count)
            except (TypeError, ValueError) as error:
                _refuse_ref_variables_under_xla(error)
                raise
            if step.summarized:
                raise ValueError(
                    f"{label}: loss_fn builds tf.summary ops, which XLA cannot compile (string "
                    f"ops): build without xla=True (mode='auto' then builds unrolled steps), "
                    f"or return the values with record= or through the loss.")
            program_graph = program.get_concrete_function(count).graph
            lint.check_captures(program_graph, watched, name=label)
            lint.warn_random_under_xla(program_graph, name=label)
            last = next(iter(outputs.values())).op
            if step.halted is not None:
                with tf.control_dependencies([last]):
                    last = step_lib.raise_if_halted(step.halted, step.var_list, label)
                with tf.control_dependencies([last]):
                    outputs = {key: tf.nest.map_structure(
                        lambda t, key=key: tf.identity(t, name="losses" if key == "loss" else key),
                        value) for key, value in outputs.items()}
        else:
            outputs, last = steps_1_to_n(count)
        with tf.control_dependencies([last]):
            train_op = tf.no_op(name="train")
    _warn_racing(graph, graph.get_operations()[first_op:], step.written, label)
    summaries, carried = outputs.pop("summary", None), outputs.pop("carry", None)
    return Unrolled(train_op=train_op, losses=outputs.pop("loss"), steps=steps,
                    summaries=summaries, carry=carried,
                    carry_in=step.initial_carry if step.carries else None,
                    var_list=tuple(step.var_list), name=label, records=outputs,
                    global_step=step.global_step, skipped_steps=step.skipped,
                    steps_per_run=run_length.variable if run_length else None,
                    mode=mode + ("+xla" if xla else ""), why=why, _run_length=run_length)


def _warn_racing(graph, ops, written, label):
    """Warn when this build writes state an earlier ``ms.unroll`` in the graph reads or
    writes, or reads state it writes: fetched in one ``sess.run``, the two would be two
    chains of steps that nothing orders against each other."""
    read = {source for op in ops for source in map(lint.source_op, op.inputs)
            if source.type in ("VarHandleOp", "VariableV2")}
    written = set(written)
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
                RuntimeWarning, stacklevel=lint.user_stacklevel())
            break
    built.append((label, written, read))


def _chain(step, feed, steps, end, watched, label, first_seconds, carried=None):
    """Steps 2..N unrolled, each after the end of the previous one (step 2 after ``end``).
    ``first_seconds``: step 1's build time, for the slow-build warning after step 2.
    ``carried``: what step 1 carried out (``carry=``). Returns (outputs, the end of the
    last step, what it carried out)."""
    outputs = []
    for k in range(2, steps + 1):
        started = time.perf_counter()
        with tf.name_scope(f"step_{k}"):
            out, next_end = step.build(k, lambda k=k: feed.args(k - 1), deps=[end], carry=carried)
        if k == 2:
            _warn_slow_build(first_seconds, time.perf_counter() - started, steps, label,
                             loop_refused=step.carries and not tf.compat.v1.control_flow_v2_enabled())
        lint.check_step(k, next_end, end, watched, name=label,
                        values=step.carry_ops if step.carries else ())
        outputs.append(out)
        end, carried = next_end, step.next_carry
    return {key: tf.stack([out[key] for out in outputs]) for key in outputs[0]}, end, carried


def _loop(step, feed, steps, after, watched, label, count, done, chunk=None, carried=None):
    """Steps 2..count as one ``tf.while_loop`` body (``count`` <= ``steps``, read at run
    time); the body reads state after the previous apply. ``done``: None, or a variable
    the loop sets to the number of steps ended so far (for InputExhaustedError).
    ``chunk``: write the per-step outputs in chunks of that many steps (``_chunked``).
    ``carried``: what step 1 carried out (``carry=``): a loop variable ("carry" among the
    arrays). Returns (outputs, the op that ends the loop, what the last step carried out)."""
    bodies, around = [], []

    def body(i, arrays, offset=0):
        bodies.append(tf.compat.v1.get_default_graph())
        out, end = step.build(i + 1, lambda: feed.args(i), deps=[i], carry=arrays.get("carry"))
        with tf.control_dependencies([end]):
            ended = [] if done is None else [done.assign(i + 1, read_value=False)]
            with tf.control_dependencies(ended):
                # A list, as the loop variables are given: v1 control flow (disable_v2_behavior)
                # checks that the body returns the same structure, list against tuple.
                written = {key: arrays[key].write(i - 1 - offset, out[key])
                           for key in arrays if key != "carry"}
                if "carry" in arrays:
                    written["carry"] = step.next_carry
                return [i + 1, written]

    def running(i):
        if step.halted is None:
            return i < count
        return tf.logical_and(i < count, tf.equal(step.halted.read_value()[0], 0))

    keys = ["loss", *step.record] + (["summary"] if step.summarized else [])
    dtypes = {key: tf.string if key == "summary" else tf.float32 for key in keys}
    graph = tf.compat.v1.get_default_graph()
    first_op = len(graph.get_operations())
    with tf.name_scope("loop"), tf.control_dependencies([after]):
        start = [] if done is None else [done.assign(1, read_value=False)]  # step 1 ended
        with tf.control_dependencies(start):
            first = tf.constant(1) if done is None else tf.identity(1)
        carry = {} if carried is None else {"carry": carried}
        if chunk is None:
            i, arrays = tf.while_loop(
                lambda i, _: running(i), body,
                [first, {**{key: tf.TensorArray(dtypes[key], size=steps - 1) for key in keys},
                         **carry}],
                parallel_iterations=1, maximum_iterations=steps - 1, name="body")
            carried = arrays.pop("carry", None)
            values = {key: array.stack() for key, array in arrays.items()}
        else:
            i, values, carried = _chunked(body, running, first, keys, steps - 1, chunk, around,
                                          carry)
    # v2 control flow: a function body; v1 (disable_v2_behavior): the loop's ops, in this graph.
    body = bodies[0] if bodies[0] is not graph else graph.get_operations()[first_op:]
    lint.check_captures(body, watched, name=label)
    for outer in around:  # chunked: what the loop over chunks captures from outside it
        lint.check_captures(outer, watched, name=label)
    # Only the count - 1 written entries: a slice XLA compiles too (bounded dynamic shape).
    return {key: value[:i - 1] for key, value in values.items()}, i.op, carried


CHUNK = 128  # per-step outputs under XLA: written in chunks of this many steps


def _chunked(body, running, first, keys, total, chunk, around, carry):
    """Steps 2..count as a loop over chunks of ``chunk`` steps, each an inner loop whose
    per-step outputs go to a TensorArray of ``chunk`` entries; the chunks stacked after.
    Under XLA one TensorArray of N entries made every step dearer past 128 entries;
    chunked, a step's cost does not grow with N (the README's bench rows).
    ``carry``: {} or {"carry": what step 1 carried out}, a loop variable of both loops.
    Returns (the i after the last step, {key: [chunks * chunk] values}, the last carry)."""
    chunks = -(-total // chunk)

    def chunk_body(c, i, kept):
        around.append(tf.compat.v1.get_default_graph())

        def inner(j, i, arrays):  # the steps of chunk c: entry i - 1 - c * chunk
            i_next, arrays_next = body(i, arrays, offset=c * chunk)
            return [j + 1, i_next, arrays_next]

        _, i, arrays = tf.while_loop(
            lambda j, i, _: tf.logical_and(j < chunk, running(i)), inner,
            [tf.constant(0), i, {**{key: tf.TensorArray(tf.float32, size=chunk, element_shape=[])
                                    for key in keys},
                                 **{key: kept[key] for key in kept if key == "carry"}}],
            parallel_iterations=1, maximum_iterations=chunk, name="chunk")
        written = {key: kept[key].write(c, arrays[key].stack()) for key in keys}
        if "carry" in arrays:
            written["carry"] = arrays["carry"]
        return [c + 1, i, written]

    _, i, kept = tf.while_loop(
        lambda c, i, _: running(i), chunk_body,
        [tf.constant(0), first, {**{key: tf.TensorArray(tf.float32, size=chunks,
                                                        element_shape=[chunk]) for key in keys},
                                 **carry}],
        parallel_iterations=1, maximum_iterations=chunks, name="chunks")
    carried = kept.pop("carry", None)
    return i, {key: tf.reshape(array.stack(), [-1]) for key, array in kept.items()}, carried


_RunLength = collections.namedtuple("_RunLength", "variable value assign read done")


def _run_length(steps, *, count_done):
    """Loop mode's run length, built with the graph (a finalized graph takes no new op):
    the local int32 variable ``steps_per_run`` (initial value ``steps``), a feed and an
    assign op that set it, and what the loop reads: the variable, or ``steps`` while it
    is uninitialised (a session that ran only global_variables_initializer). With
    ``count_done`` (a tf.data input), also a local variable the loop sets to the steps
    ended so far in a run, for InputExhaustedError's message."""
    local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
    variable = tf.compat.v1.Variable(steps, dtype=tf.int32, trainable=False, use_resource=True,
                                     collections=local, name="steps_per_run")
    with tf.compat.v1.name_scope(variable.op.name + "/"):
        value = tf.compat.v1.placeholder(tf.int32, [], name="value")
        assign = variable.assign(value, read_value=False, name="set")
        read = tf.cond(variable.is_initialized(), variable.read_value,
                       lambda: tf.constant(steps), name="count")
    done = None
    if count_done:
        done = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, use_resource=True,
                                     collections=local, name="steps_done")
    return _RunLength(variable, value, assign, read, done)


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


def _refuse_ref_variables_under_xla(error):
    """An XLA program that failed to build over ref variables (TensorFlow's error names
    an op's ``float32_ref`` input, or none at all): the reason, said plainly."""
    graph = tf.compat.v1.get_default_graph()
    ref = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
           if v.op.type != "VarHandleOp"]
    if ref:
        named = [v for v in ref if v.op.name in str(error)] or ref
        try:
            step_lib.check_capturable(named, "xla=True", compiled=True)
        except TypeError as refused:
            raise refused from error


def _check_replica_context(optimizer, mode, xla, nonfinite):
    """What a tf.distribute replica context, and SyncReplicasOptimizer, rule out."""
    if isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer):
        raise TypeError(
            "SyncReplicasOptimizer cannot be unrolled: each apply_gradients call creates its "
            "own shared gradient accumulators and a token queue that the chief fills once per "
            "update, and it may be called only once per graph, so N applies per run cannot be "
            "built. For synchronous data parallelism use a tf.compat.v1.distribute strategy "
            "(MirroredStrategy on one machine, experimental.MultiWorkerMirroredStrategy across "
            "workers), whose all-reduce runs in every inner step: build with "
            "ms.distribute.unroll(strategy, loss_fn, optimizer, steps) and the plain optimizer "
            "SyncReplicasOptimizer wraps.")
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return
    refused = {"mode='while_loop'": mode == "while_loop", "xla=True": xla,
               "nonfinite='skip'": nonfinite == "skip"}
    what = [option for option, given in refused.items() if given]
    if what:
        raise ValueError(
            f"ms.unroll in the replica context of {type(tf.distribute.get_strategy()).__name__}: "
            f"{what[0]} would put each step's apply inside a tf.while_loop, tf.function or tf.cond body, "
            f"and the apply all-reduces the gradients through the strategy's merge_call, which "
            f"cannot run inside a control-flow body in replica context. Use mode='unrolled' "
            f"(the default), xla=False and nonfinite='raise' or 'ignore' under a strategy.")


def _check_record(record, optimizer):
    if isinstance(record, str):
        record = (record,)
    record = tuple(record)
    for name in record:
        if name not in RECORDS:
            raise ValueError(f"record: unknown quantity {name!r}; choose from {RECORDS}.")
    if "learning_rate" in record and step_lib.learning_rate_of(optimizer) is None:
        raise ValueError(f"record: cannot find the learning rate of "
                         f"{type(optimizer).__name__} (no _learning_rate or _lr attribute).")
    return record


def _warn_slow_build(first_seconds, second_seconds, steps, label, *, loop_refused=False):
    """Warn, after step 2, when steps 1 and 2's build times predict a slow unrolled build.

    Step 2 is the one that repeats: step 1 also creates the variables and slots (under
    XLA, from inside the program's tracing), so it alone would overstate the rest.
    ``loop_refused``: loop mode would refuse this build (``carry=`` under v1 control
    flow), so it is not the advice.
    """
    predicted = first_seconds + (steps - 1) * second_seconds
    if predicted > SLOW_BUILD_SECONDS:
        advice = (f"mode='while_loop' builds step 1 and one loop body whatever N, about "
                  f"{first_seconds + second_seconds:.1f} s here, with the same results."
                  if not loop_refused else
                  "mode='while_loop' would build one loop body whatever N, but it refuses "
                  "carry= under v1 control flow (disable_v2_behavior): build fewer steps a "
                  "run, or xla=True (its loop is a function's, v2), or turn v2 control flow "
                  "on (tf.compat.v1.enable_control_flow_v2()) with resource variables.")
        warnings.warn(
            f"{label}: step 2 took {second_seconds * 1e3:.0f} ms to build (step 1, with the "
            f"variables and slots, {first_seconds * 1e3:.0f} ms), so {steps} unrolled steps will "
            f"take about {predicted:.0f} s to build (and their first run longer, and memory with "
            f"N). {advice}", RuntimeWarning, stacklevel=lint.user_stacklevel())


def _check_graph_size(graph, step_bytes, steps, label):
    now = sum(op.node_def.ByteSize() for op in graph.get_operations())
    estimate = now + (steps - 1) * step_bytes
    if estimate > GRAPHDEF_LIMIT:
        raise GraphTooLargeError(
            f"{label}: {steps} unrolled steps of about {step_bytes / 2**20:.1f} MiB each "
            f"would make a GraphDef of about {estimate / 2**30:.1f} GiB, over protobuf's "
            f"2 GiB limit. Use mode='while_loop' (one step body whatever N), a smaller "
            f"N, or feed large constants through placeholders instead of embedding them.")


def positive_int(what, value):
    """``value`` as an int, if it is an integer >= 1; else a TypeError or ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int >= 1, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value}.")
    return int(value)


def _check_loss_fn(loss_fn):
    if isinstance(loss_fn, (tf.Tensor, tf.Variable, tf.Operation)):
        raise TypeError(
            f"loss_fn must be a callable that builds the loss, got the tensor "
            f"{loss_fn.name!r}. A loss tensor built once is evaluated once per "
            f"sess.run, so every inner step would reuse the old forward pass. "
            f"Wrap the code that builds it: loss_fn=lambda: <build the loss>.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")


def _check_optimizer(optimizer):
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(
            f"optimizer must be a tf.compat.v1.train.Optimizer (e.g. "
            f"tf.compat.v1.train.AdamOptimizer(1e-3)), got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}. Keras "
            f"optimizers are not supported: they manage their own step counter.")


def _check_transforms(grad_transforms):
    """One transform for the whole list, with sparse rows summed first; None if empty."""
    if callable(grad_transforms):
        raise TypeError("grad_transforms must be a list of transforms; wrap the one you "
                        "have in a list, or combine several with ms.chain.")
    grad_transforms = tuple(grad_transforms)
    for i, t in enumerate(grad_transforms):
        if not callable(t):
            raise TypeError(f"grad_transforms[{i}] must be callable "
                            f"(grads_and_vars, step) -> grads_and_vars, got {t!r}.")
    if not grad_transforms:
        return None
    return transforms.chain(*grad_transforms)  # (run after dedupe_sparse: apply_deduped)


def _as_tf_variable(value):
    """A tf.Variable, unwrapping Keras 3 variables (whose ``.value`` is one)."""
    if isinstance(value, tf.Variable):
        return value
    inner = getattr(value, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    return None


def _check_var_list(var_list):
    if var_list is None:
        return None
    if isinstance(var_list, (tf.Variable, tf.Tensor)):
        raise TypeError("var_list must be a list of variables, got a single "
                        f"{type(var_list).__name__}; wrap it in a list.")
    out = []
    for i, value in enumerate(var_list):
        var = _as_tf_variable(value)
        if var is None:
            raise TypeError(f"var_list[{i}] must be a variable, got {value!r}.")
        out.append(var)
    if not out:
        raise ValueError("var_list is empty: there is nothing to train.")
    return tuple(out)


def _check_global_step(global_step):
    if global_step is None:
        return None
    var = _as_tf_variable(global_step)
    if var is None or not var.dtype.base_dtype.is_integer:
        raise TypeError(
            f"global_step must be an integer variable (e.g. "
            f"tf.compat.v1.train.get_or_create_global_step()), got {global_step!r}.")
    return var


