"""The single step: forward, gradients, transform, checks, side effects, apply.

``ms.unroll`` builds the canonical single step once, under ``multistep/step/``, and the
compiler (``multistep.compiler.compile``) runs it N times. In this order (each a name scope):

    inputs       the step's batch: placeholders the compiler feeds slice k at step k,
                 or the next element of an iterator
    forward      loss = loss_fn(*inputs), and its update ops
    gradients    d loss / d var_list (after the update ops, as a single step's
                 ``control_dependencies(UPDATE_OPS)`` orders them)
    transform    the gradient transforms
    record       per-step quantities
    check        the non-finite policy
    apply        optimizer.apply_gradients
    after_apply  the user's per-step ops, after the apply

It also creates the variables (the model's, the optimizer's slots, the after_apply's),
with the names a single-step graph gives them.
"""

import contextlib
import dataclasses
import re
import warnings

import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops  # XlaOptimizationBarrier
from tensorflow.python.ops import gen_resource_variable_ops

from multistep import graph as graph_lib
from multistep.builder import lint
from multistep.builder import scopes
from multistep.builder import transforms

__all__ = ["CreationGuard", "Step", "check_capturable", "in_replica_context",
           "learning_rate_of"]

# What a non-finite check says; Unrolled.run names the step (the copy its op is in).
NONFINITE_STEP = "an inner step"


@dataclasses.dataclass
class Step:
    """Builds the single step: forward, update ops, gradients, transform, checks, apply,
    after_apply, in that order."""

    loss_fn: object
    optimizer: object
    var_list: tuple
    global_step: object
    transform: object
    guard: object
    record: tuple
    nonfinite: str
    update_ops: object = True
    after_apply: object = None
    label: str = "multistep"
    skipped: object = None
    halts: bool = False  # xla=True, nonfinite="raise": halt (_halt_unless_finite)
    halt: object = None  # then {"in"/"out": (halted,) in a loop, else (ok, halted); "looped"}
    xla: bool = False  # built to run in an XLA program (_apply_where, a halt state)
    looped: bool = False  # built as a loop's body (mode="while_loop")
    written: dict = dataclasses.field(default_factory=dict)  # variable op -> name, of every write
    gradient_options: dict = dataclasses.field(default_factory=dict)  # for compute_gradients
    before_apply: list = None  # the loss, outputs and gradients
    apply_scope: str = None  # the apply name scope
    summarized: bool = False  # loss_fn built tf.summary ops (outputs["summary"])
    initial_carry: object = None  # carry=: the nest the first step is given
    next_carry: object = None  # what loss_fn carried out

    @property
    def carries(self):
        return self.initial_carry is not None

    def build(self, args, carry=None):
        """The step, reading ``args`` (and ``carry``, the state the step before carried
        out: placeholders the compiler links). Returns ({"loss": ..., each recorded
        quantity, "summary": float32 and string scalars}, the op that ends the step: its
        apply, or the end of its ``after_apply``); what it carries out is ``next_carry``."""
        graph = tf.compat.v1.get_default_graph()
        scope = graph.get_name_scope() + "/"
        first_op, created = len(graph.get_operations()), len(self.guard.created)
        keys = scopes.op_collections_of(graph)
        start = {key: len(graph.get_collection(key)) for key in keys}
        with self.guard.scope("forward") as forward_scope:
            if self.carries:
                loss = self._carrying(args, carry)
            else:
                loss = _call_loss_fn(self.loss_fn, args)
        added = {key: graph.get_collection(key)[start.get(key, 0):]
                 for key in scopes.op_collections_of(graph)}
        collected = [_as_op(u) for u in added.get(tf.compat.v1.GraphKeys.UPDATE_OPS, [])]
        _step_updates(graph).update(collected)
        initializers = _initializers(self.guard.created[created:])
        created = len(self.guard.created)
        forward = graph.get_operations()[first_op:]
        run_first = self._update_ops(collected, forward, initializers)
        summaries = added.get(tf.compat.v1.GraphKeys.SUMMARIES, [])
        self.summarized = bool(summaries)
        scopes.retag(summaries, forward_scope)
        extra = {"summary": _merged(summaries)} if summaries else {}
        with tf.control_dependencies(run_first):
            outputs, apply_op = self._descend(loss, extra)
        end = apply_op if self.nonfinite == "skip" or self.xla else self._after(apply_op)
        initializers |= _initializers(self.guard.created[created:])  # slots, EMA shadows, ...
        ops = graph.get_operations()[first_op:]
        _refuse_gradients_reading_updates(ops, run_first, self.label)
        self.written.update(graph_lib.written_variables(ops))
        exempt = initializers | (set(collected) if self.update_ops is False else set())
        exempt |= _other_replicas_ops(ops, scope)
        lint.check_dangling(ops, end, exempt=exempt, name=self.label, step=1)
        return outputs, end

    def _carrying(self, args, carry):
        """``loss_fn(*args, carry) -> (loss, next carry)``; returns the loss and keeps the
        next carry. The carry comes in through ``StopGradient``: the value a single step
        is fed (its initial state placeholder), not a path back into earlier steps."""
        step = 1
        carry_in = tf.nest.map_structure(lambda t: tf.stop_gradient(t, name="carry"), carry)
        returned = self.loss_fn(*args, carry_in)
        if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
            raise TypeError(f"with carry=, loss_fn(*inputs, carry) must return (loss, next "
                            f"carry); at inner step {step} it returned {type(returned).__name__}.")
        loss, next_carry = returned
        try:
            tf.nest.assert_same_structure(carry, next_carry)
        except (TypeError, ValueError) as error:
            raise ValueError(f"the carry loss_fn returns at inner step {step} differs in "
                             f"structure from the carry it was given: {error}") from None
        def checked(index, before, after):
            where = f"the carry's item {index} (flattened)"
            if after is None:
                raise ValueError(f"loss_fn carried out None as {where} at inner step {step}: "
                                 f"return the next value of every carried tensor.")
            after = tf.convert_to_tensor(after)
            if after.dtype != before.dtype:
                raise TypeError(f"loss_fn carried out {where} as {after.dtype.name} at inner "
                                f"step {step}; carry= gave it as {before.dtype.name}. Return "
                                f"it in the carry's dtype (tf.cast(..., {before.dtype.name})).")
            if not after.shape.is_compatible_with(before.shape):
                raise ValueError(f"loss_fn carried out {where} with shape {after.shape} at "
                                 f"inner step {step}; carry= gave it with shape {before.shape}.")
            return tf.ensure_shape(after, before.shape)

        self.next_carry = tf.nest.pack_sequence_as(carry, [
            checked(i, before, after) for i, (before, after) in enumerate(
                zip(tf.nest.flatten(carry), tf.nest.flatten(next_carry)))])
        return _call_loss_fn(lambda *_: loss, ())

    def _descend(self, loss, extra=None):
        """Gradients, transforms, records, checks and the apply of ``loss``: (outputs, the
        apply op). ``extra``: more outputs (the step's summaries), computed before the
        apply as the loss is."""
        with self.guard.scope("gradients"):
            grads_and_vars = self._gradients(loss)
        if self.transform is not None:
            with self.guard.scope("transform"):
                now = None if self.global_step is None else self.global_step.read_value()
                grads_and_vars = transforms.apply_transform(self.transform, grads_and_vars, now)
        outputs = {"loss": tf.cast(loss, tf.float32), **(extra or {})}
        if self.record:
            with self.guard.scope("record"):
                outputs.update(_records(self.record, self.optimizer, grads_and_vars))
        kept = None
        if self.nonfinite == "raise" and not self.halts and not self.xla:
            with self.guard.scope("check"):
                loss, grads_and_vars = self._checked(loss, grads_and_vars)
        elif self.nonfinite == "raise" and self.halts:  # compiled: halt, raise after
            with self.guard.scope("check"):
                finite, otherwise, kept = self._halt_unless_finite(loss, grads_and_vars)
        elif self.nonfinite == "skip":
            with self.guard.scope("check"):
                finite, otherwise = _all_finite([loss] + [g for g, _ in grads_and_vars]), self._skip
        elif self.xla and not self.looped:  # XLA, unrolled, nonfinite="ignore" (or auto's trial)
            finite, otherwise = _opaque_true(), tf.no_op
        elif self.xla:  # XLA, loop mode, nonfinite="ignore": a step is one iteration
            finite = None
        # What a phase run beside this one (phases="simultaneous") orders its apply after.
        self.before_apply = [loss, *outputs.values()] + [
            g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in grads_and_vars
            if g is not None]
        with (self.guard.scope("apply") as self.apply_scope,
              tf.control_dependencies([loss, *outputs.values()])):
            if self.nonfinite == "skip" or self.xla and not self.looped:
                applied, carried = self._apply_if(finite, grads_and_vars, otherwise, kept)
                if self.halts:
                    self.halt["out"] = (tf.identity(applied, name="ok_out"),
                                        tf.identity(carried[0], name="halted_out"))
                return outputs, applied.op
            if self.xla:
                return outputs, self._apply_where(finite, grads_and_vars)
            with self._slots_scope():
                return outputs, _apply_op(self.optimizer.apply_gradients(
                    grads_and_vars, global_step=self.global_step))

    def _slots_scope(self):
        """Where the apply runs. In the replica context of a ``tf.distribute``
        strategy, the step's ``merge_call`` creates the optimizer's variables (slots,
        Adam's ``beta1_power``) in cross-replica context, outside this step's variable
        creator, named under the first replica's name scope: there the apply runs in
        the scope ``ms.unroll`` was called in, so they get a single step's names (its
        update ops then sit beside ``name/step``, their copies under
        ``name/step_k/_outside/``). Elsewhere: the current scope."""
        if not in_replica_context():
            return contextlib.nullcontext()
        return self.guard.graph.name_scope(self.guard.base + "/" if self.guard.base else "")

    def _gradients(self, loss):
        """``compute_gradients``' result (``minimize``'s options as given)."""
        if callable(self.var_list):  # a phase's: the variables its loss_fn call made
            returned = self.var_list()
            found = (tuple(returned) if isinstance(returned, (list, tuple)) else returned)
            if (not isinstance(found, tuple) or not found
                    or not all(isinstance(v, tf.Variable) for v in found)):
                raise TypeError(f"a phase's var_list() must return a non-empty list of "
                                f"variables, got {returned!r}.")
            self.var_list = found
        grads_and_vars = self.optimizer.compute_gradients(
            loss, var_list=list(self.var_list) if self.var_list else None,
            **self.gradient_options)
        if self.var_list is None:
            grads_and_vars = _trained_pairs(grads_and_vars)
            self.var_list = tuple(v for _, v in grads_and_vars)
        _check_gradients(grads_and_vars)
        return grads_and_vars

    def _update_ops(self, collected, forward, initializers):
        """The ops step k runs after its forward pass and before its gradients and apply."""
        if self.update_ops is False:
            return []
        if self.update_ops == "all":
            own = [op for op in forward if op not in initializers]
            graph_lib.order_as_built(own)
            listed = set(collected)
            writes = [op for op in own if graph_lib.is_write(op) and op not in listed]
            # A stateful cond or call may hold writes: a tf-keras layer's update under a
            # `training` placeholder is a cond whose branch assigns (smart_cond). Built in a
            # graph (not a function), its branches list no control outputs, so a control
            # input on the cond runs no write: its outputs must be computed.
            calls = [op for op in own if op.type in graph_lib.CALL_OPS and op._is_stateful
                     and op not in listed and op.outputs]
            with tf.name_scope("update_ops"):
                computed = [tf.identity(t).op for op in calls for t in op.outputs]
            return collected + writes + computed
        return collected

    def _after(self, apply_op):
        """``after_apply``'s ops, after ``apply_op``; the op that ends the step."""
        if self.after_apply is None:
            return apply_op
        with self.guard.scope("after_apply"), tf.control_dependencies([apply_op]):
            ops = _after_apply_ops(self.after_apply())
            with tf.control_dependencies([apply_op, *ops]):
                return tf.no_op(name="done")

    def _checked(self, loss, grads_and_vars):
        """The loss and gradients through CheckNumerics: a non-finite value stops the run
        before this step's apply, with a message naming the step and the variable.

        The checks run one after another, the gradients in ``var_list`` order and then
        the loss, so that when several values are non-finite the same one is reported
        every time (unordered, whichever check ran first raised: a race).
        """
        previous = []

        def check(x, what):
            message = (f"{self.label}: {NONFINITE_STEP} has a non-finite {what}; that step was not "
                       f"applied, the steps before it were (nonfinite='skip' skips such steps)")
            values = x.values if isinstance(x, tf.IndexedSlices) else x
            # One scalar a tensor: x * 0 is 0 where x is finite, NaN where it is Inf or NaN,
            # so its sum is finite exactly when every value is. CheckNumerics on the whole
            # tensor cost 16 % of an autoencoder's step (issue 28); the sum is one pass.
            with tf.control_dependencies(previous):
                flag = tf.debugging.check_numerics(
                    tf.reduce_sum(values * tf.zeros([], values.dtype)), message)
            previous[:] = [flag]
            with tf.control_dependencies([flag]):
                checked = tf.identity(values)
            if isinstance(x, tf.IndexedSlices):
                return tf.IndexedSlices(checked, x.indices, x.dense_shape)
            return checked

        grads_and_vars = [(None if g is None else check(g, f"gradient for {v.op.name!r}"), v)
                          for g, v in grads_and_vars]
        return check(loss, "loss"), grads_and_vars

    def _halt_unless_finite(self, loss, grads_and_vars):
        """XLA does not raise from CheckNumerics (it compiles to nothing), so in a compiled
        program ``nonfinite="raise"`` halts instead: the first step with a non-finite
        value, and every step after it, applies nothing (a loop stops after it; unrolled,
        the later steps' forward passes and update ops still run), and the check after
        the program (``raise_if_halted``) raises. The halt state is carried from step to
        step as ``carry=`` is (the compiler links ``halt["in"]`` to the step before's
        ``halt["out"]``, and outputs the last step's from the XLA program). In loop mode it
        is one int, ``halted``: ``1 +`` the index of the step's first non-finite value
        (gradients in ``var_list`` order, then the loss, as ``_checked`` orders its
        checks), 0 if none; the loop stops after a step whose ``halted`` is not 0, so it is
        computed afresh each step and is the last step's. XLA computes it in one fusion
        with the is-finite tests (the form before it, a bool and an index from a stack of
        flags, took 3 kernels a step more: on blobs at N = 1000, raise cost 1.13x ignore
        with that form, 1.07x with this one).
        Unrolled: ``ok``, no step has halted, and ``[the step that halted (0: none), 1 + that
        index, steps so far]``. No variable: nothing to reset or read on the host.
        Returns (whether to apply, then ``_apply_if``'s ``otherwise`` and ``kept``: in
        loop mode None, as ``_apply_where`` takes none)."""
        values = [g for g, _ in grads_and_vars] + [loss]
        if self.looped:  # one int: XLA computes it in one fusion with the is-finite tests
            halted = 0  # (no step reads halted_in: the loop stops after a step that halts)
            for k in reversed(range(len(values))):
                halted = tf.where(_all_finite([values[k]]), halted, k + 1)
            halted = tf.identity(halted, name="halted_out")
            self.halt = {"in": (tf.compat.v1.placeholder(tf.int32, [], name="halted_in"),),
                         "out": (halted,), "looped": True}
            return tf.equal(halted, 0), None, None
        # Unrolled keeps its stack of flags: the select chain above, there, changed how XLA
        # fused the steps' applies, and unrolled-5-Adam-clip went off the single step.
        carried = [tf.compat.v1.placeholder(tf.bool, [], name="ok_in"),
                   tf.compat.v1.placeholder(tf.int32, [3], name="halted_in")]
        ok, halted = carried
        flags = tf.stack([_all_finite([v]) for v in values])
        which = tf.reduce_min(tf.where(flags, len(values), tf.range(len(values))))
        apply = tf.logical_and(ok, tf.reduce_all(flags))
        self.halt = {"in": tuple(carried), "looped": False}
        at = halted + [0, 0, 1]  # this step's number, in the program's run

        def halt():  # (the halt state if this step does not apply)
            return [tf.where(ok, tf.stack([at[2], which + 1, at[2]]), at)]
        return apply, halt, lambda: [at]  # unrolled: out of the cond of _apply_if

    def _skip(self):
        """A skipped step (``nonfinite="skip"``): advance the global step, count the skip."""
        count = self.skipped
        if self.xla:  # XLA takes initialised variables only
            updates = [count.assign_add(1)]
        else:  # a local variable: the first skip of a session that did not initialise it
            updates = [tf.cond(count.is_initialized(),
                               lambda: count.assign_add(1, read_value=False),
                               lambda: count.assign(1, read_value=False))]
        if self.global_step is not None:
            updates.append(self.global_step.assign_add(1))
        return tf.group(*updates)

    def _apply_where(self, keep, grads_and_vars):
        """Under XLA, in loop mode: the apply (and ``after_apply``), then, where ``keep``
        is given (``nonfinite="raise"``: whether the step applies), every variable they
        write set to ``where(keep, its new value, its value before)``: a select that XLA
        fuses into the apply's own loops, where a ``tf.cond`` around the apply is a
        conditional that copies the state in and out each step. ``keep`` None
        (``"ignore"``): the plain apply, as the single step's. (Unrolled, each apply
        stays in a cond: see ``_opaque_true``.)"""
        self._check_capturable(grads_and_vars)
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with self._slots_scope():
            applied = self._after(_apply_op(self.optimizer.apply_gradients(
                grads_and_vars, global_step=self.global_step)))
        if keep is None:
            return applied
        new = set(graph.get_operations()[first:])
        writes = [op for op in graph_lib.ancestors([applied]) if op in new and graph_lib.is_write(op)]
        before = {}
        for op in writes:  # each variable read before the first write to it
            # (an optimizer's ResourceApply* op writes each of its resources: the
            # variable and its slots; an assign or scatter writes its first input)
            written = [t for t in op.inputs if t.dtype == tf.resource] \
                if op.type.startswith(("ResourceApply", "ResourceSparseApply")) else op.inputs[:1]
            for handle in map(graph_lib.source_op, written):
                if handle not in before:
                    before[handle] = gen_resource_variable_ops.read_variable_op(
                        handle.outputs[0], handle.get_attr("dtype"), name="before")
                op._add_control_inputs([before[handle].op])  # noqa: SLF001 (as graph_lib.order_as_built)
        with tf.control_dependencies([applied]):
            return tf.group(*[gen_resource_variable_ops.assign_variable_op(
                handle.outputs[0], tf.where(keep, gen_resource_variable_ops.read_variable_op(
                    handle.outputs[0], value.dtype), value), name="kept")
                for handle, value in before.items()], name="applied")

    def _check_capturable(self, grads_and_vars):
        check_capturable([v for _, v in grads_and_vars] + (
            [self.global_step] if self.global_step is not None else []),
            "nonfinite='skip'" if self.nonfinite == "skip" else "xla=True",
            compiled=self.xla)

    def _apply_if(self, finite, grads_and_vars, otherwise, kept=None):
        """Apply when ``finite``; else run ``otherwise()`` (skip, or halt). Returns (whether
        it applied, then what ``kept()`` gives when it applies and ``otherwise()`` when
        not: tensors the cond carries out, the halt state)."""
        self._check_capturable(grads_and_vars)

        def apply():  # a skipped step runs no after_apply: only this branch has one
            with tf.control_dependencies([self._after(self.optimizer.apply_gradients(
                    grads_and_vars, global_step=self.global_step))]):
                return [tf.constant(True)] + ([tf.identity(t) for t in kept()] if kept else [])

        def skip():
            if kept:
                return [tf.constant(False)] + otherwise()
            with tf.control_dependencies([otherwise()]):
                return [tf.constant(False)]

        applied, *carried = tf.cond(finite, apply, skip, name=_IF_FINITE)
        return applied, carried

    def state(self):
        """The variables the steps train and count: weights, optimizer slots, global step,
        skip counter (``written`` has every variable a step writes, these and others)."""
        state = list(self.var_list) + self.optimizer.variables()
        return state + [v for v in (self.global_step, self.skipped) if v is not None]


def _step_updates(graph):
    """The UPDATE_OPS the steps of every ``ms.unroll`` in ``graph`` built, kept on the
    graph (a module-level map from graphs to their ops would keep every graph alive)."""
    if not hasattr(graph, "_multistep_step_updates"):
        graph._multistep_step_updates = set()
    return graph._multistep_step_updates


def warn_outside_updates(graph, label):
    """Warn about ops in UPDATE_OPS that no ``loss_fn`` built (as ``ms.unroll`` starts):
    a single step under ``control_dependencies(UPDATE_OPS)`` runs them every step; a
    fused step runs only the update ops its own ``loss_fn`` call adds."""
    known = _step_updates(graph)
    outside = [op for op in map(_as_op, graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
               if op not in known]
    if outside:
        names = ", ".join(f"'{op.name}' ({op.type}){graph_lib.built_at(op)}" for op in outside[:3])
        warnings.warn(
            f"{label}: tf.compat.v1.GraphKeys.UPDATE_OPS holds {len(outside)} op(s) built "
            f"outside loss_fn: {names}{', ...' if len(outside) > 3 else ''}. A single step "
            f"under control_dependencies(UPDATE_OPS) runs them every step; ms.unroll runs the "
            f"update ops that loss_fn adds as it builds each step, so these run in no step. "
            f"Build them inside loss_fn (call the layer there), or, to run after each step's "
            f"apply, in after_apply.", RuntimeWarning, stacklevel=graph_lib.user_stacklevel())


def _merged(summaries):
    """The summaries one step's ``loss_fn`` built (its additions to ``SUMMARIES``: each
    step's own, as ``scopes.Collections`` keeps them), merged into one serialized ``Summary``:
    ``Unrolled.summaries[k]``, which ``ms.hooks.StepSummaryHook`` writes at step k's
    global step. A single step's ``SummarySaverHook`` fetches ``merge_all()`` beside the
    train op; here it is computed before the step's apply, as the loss is."""
    return tf.compat.v1.summary.merge(summaries, name="summaries")


def _refuse_gradients_reading_updates(ops, updates, label):
    """Raise ValueError if an update op (``UPDATE_OPS``, run after the forward pass and
    before the gradients) writes a ref variable that one of the step's gradient ops
    reads. A ref variable is read when its consumer runs, through the one ``v/read``
    alias: the gradient would see the value after the write, where the forward pass saw
    the one before (an RNN state kept in a variable and updated through UPDATE_OPS was
    1.4e-3 off the feed-dict original). A resource variable's reads are snapshots."""
    written = {graph_lib.ref_variable_of(u.inputs[0]): u for u in updates
               if graph_lib.is_write(u) and graph_lib.ref_variable_of(u.inputs[0]) is not None}
    if not written:
        return
    for op in ops:
        # A cond or a switch passes the value on to a branch that may not run (batch norm's
        # inference branch, which reads its moving mean): the ops that compute with it say.
        if ("/gradients/" not in "/" + op.name or graph_lib.is_write(op) or op.type in graph_lib.ALIAS_OPS
                or op.type in graph_lib.CALL_OPS or op.type in _V1_CONTROL_FLOW):
            continue
        for tensor in op.inputs:
            variable = graph_lib.ref_variable_of(tensor)
            if variable in written:
                raise ValueError(
                    f"{label}: the update op '{written[variable].name}' writes "
                    f"'{variable.name}' (a ref variable) in UPDATE_OPS, which run before the "
                    f"step's gradients, and the gradient op '{op.name}' ({op.type}) reads "
                    f"'{variable.name}' through its ref: it would see the value after the "
                    f"write, where the forward pass saw the one before. To carry state from "
                    f"step to step (an RNN's final state), use carry=; else make the variable "
                    f"a resource variable (use_resource=True), whose reads are snapshots.")


def _opaque_true():
    """True, as XLA cannot see it: the predicate of the cond that holds a compiled step's
    apply when nothing is checked (``nonfinite="ignore"``).

    In one XLA program, step k reads what step k-1 assigned, and XLA's algebraic
    simplifier reaches across steps: Adam's ``beta1_power * beta1``, step after step,
    became a multiplication by a folded constant, and the unrolled program drifted from
    the single-step program (the blobs model with Adam: ``beta1_power`` 5.2e-6 off after
    30 steps). Each apply in a cond, as ``nonfinite="raise"`` and ``"skip"`` put it, is a
    computation of its own that the simplifier does not fuse with the next step's; the
    predicate passes an optimization barrier so that XLA cannot fold the cond away."""
    [true] = gen_xla_ops.xla_optimization_barrier([tf.constant(True)], name="opaque_true")
    return true


def _as_op(value):
    """The op of an op, a tensor or a variable (an update op may be any of them)."""
    if isinstance(value, tf.Operation):
        return value
    return value.op


def in_replica_context():
    """Inside ``call_for_each_replica`` of a ``tf.distribute`` strategy."""
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def _other_replicas_ops(ops, scope):
    """Of ``ops`` (those made since this step started), the ones this step may leave
    unreached: in the replica context of a ``tf.distribute`` strategy, those other
    replicas built and the initialisers of the variables the ``merge_call`` made
    (optimizer slots, created in cross-replica context, where the step's variable
    creator is not). The replicas build their steps in turns, each pausing in its
    apply's ``merge_call`` while the others build theirs; this replica's ops are those
    under its step's name ``scope`` (``replica_1/multistep/step_2/``, ...), and the
    all-reduce and the variables' updates sit under the first replica's apply.
    Outside a replica context: none."""
    if not in_replica_context():
        return set()
    made = set(ops)
    strategy = tf.distribute.get_strategy()
    variables = tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
    created = [local for v in variables for local in strategy.experimental_local_results(v)
               if getattr(local, "initializer", None) in made]
    return {op for op in ops if not op.name.startswith(scope)} | _initializers(created)


def _apply_op(applied):
    """The op of what ``apply_gradients`` returned. In the replica context of a
    ``tf.distribute`` strategy that is this replica's value of its ``merge_call``
    (the global step's update: a tensor, after every replica's variable updates)."""
    if isinstance(applied, (tf.Operation, tf.Tensor)):
        return _as_op(applied)
    local = tf.distribute.get_strategy().experimental_local_results(applied)
    return tf.group(*[_as_op(v) for v in tf.nest.flatten(local)])


def _initializers(variables):
    """The ops that initialise ``variables`` (and their initial values): run by the
    initialiser, not by a step, so never dangling."""
    roots = [v.initializer for v in variables if getattr(v, "initializer", None) is not None]
    return graph_lib.ancestors(roots)


def _after_apply_ops(returned):
    """What ``after_apply`` returned, as a list of ops and tensors."""
    flat = [] if returned is None else tf.nest.flatten(returned)
    for value in flat:
        if not isinstance(value, (tf.Operation, tf.Tensor, tf.Variable)):
            raise TypeError(
                f"after_apply must return an op, a tensor, a list of them or None; it "
                f"returned {type(value).__name__} ({value!r}).")
    return [v.op if isinstance(v, tf.Variable) else v for v in flat]


def _records(record, optimizer, grads_and_vars):
    """This step's recorded quantities, float32 scalars."""
    out = {}
    if "grad_norm" in record:
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        grads = [g for g, _ in pairs]
        if in_replica_context():
            # The applied gradient is the replicas' sum, not this replica's part: summed
            # as the optimizer's apply sums it (batch_reduce_to onto the variables), the
            # norm of the sum, the same in every replica.
            def summed(strategy, pairs):
                return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)

            grads = tf.distribute.get_replica_context().merge_call(summed, args=(pairs,))
        # In float32 whatever the variables' dtypes (float16, float64, mixed), as documented.
        out["grad_norm"] = tf.linalg.global_norm([
            tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g, tf.float32)
            for g in grads])
    if "learning_rate" in record:
        lr = learning_rate_of(optimizer)
        out["learning_rate"] = tf.cast(lr() if callable(lr) else lr, tf.float32)
    return out


def learning_rate_of(optimizer):
    for attr in ("_learning_rate", "_lr"):
        if hasattr(optimizer, attr):
            return getattr(optimizer, attr)
    return None


def raise_if_halted(state, var_list, label, made=None):
    """After a compiled program: an op that raises (InvalidArgumentError) if a step halted
    it (``Step._halt_unless_finite``; ``state``, the last step's halt state, and in loop
    mode ``made``, the steps the loop made, are outputs of the program). A few nodes on
    the host, an ``Assert`` and its message (a loop's: and an ``Equal``): it gives the
    step and the value by number, and ``halt_message`` the message a ``CheckNumerics``
    gives unrolled."""
    whats = _halt_values(var_list)
    message = (f"{label}: {HALTED}: that step and those after it were not applied, the steps "
               f"before it were (nonfinite=skip skips such steps). [the step, its non-finite "
               f"value ({', '.join(f'{k + 1}: {w}' for k, w in enumerate(whats))}); "
               f"unrolled, then the steps run] =")
    if made is None:  # unrolled: ok, [step, 1 + value, steps]
        ok, halted = state
        data = [message, halted]
    else:  # a loop's: 1 + the value's index, 0 if none
        [halted] = state
        ok, data = tf.equal(halted, 0), [message, made, halted]
    return tf.debugging.Assert(ok, data, name="check_finite")


HALTED = "a step had a non-finite value and halted the run"


def _halt_values(var_list):
    """What a halt's value index (from 1) names: the gradients, then the loss, as
    ``_halt_unless_finite`` checks them. (Assert escapes quotes in the strings it
    prints: the names go unquoted.)"""
    return [f"gradient for variable {v.op.name}" for v in var_list] + ["loss"]


def halt_message(label, var_list, message):
    """The message of ``raise_if_halted``'s error as a ``CheckNumerics`` gives it unrolled
    (``Unrolled.run`` raises it), or None for another error."""
    found = re.search(rf"{re.escape(label)}: {HALTED}: .*? =\]((?: \[?\d+\]?)+)", message)
    if found is None:
        return None
    step, which = map(int, re.findall(r"\d+", found.group(1))[:2])
    return (f"{label}: inner step {step} has a non-finite "
            f"{_halt_values(var_list)[which - 1]}; that step and "
            f"those after it were not applied (unrolled, their update ops, such as moving "
            f"statistics, still ran), the steps before it were (nonfinite=skip skips such "
            f"steps)")


def _all_finite(tensors):
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors if t is not None]
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


def check_capturable(variables, what, *, compiled):
    """Raise TypeError if a ``tf.while_loop`` or ``tf.cond`` body (``compiled``: an XLA
    program) could not use ``variables``. A ref variable (``use_resource=False``, what
    ``disable_v2_behavior()`` makes) lives in v1 control flow's frames (RefEnter,
    RefSwitch), as TF1 ran its loops; a v2 body is a function, which captures only
    resource handles, and XLA compiles only resource variables."""
    ref = [v.op.name for v in variables if v.op.type != "VarHandleOp"]
    if not ref or not (compiled or tf.compat.v1.control_flow_v2_enabled()):
        return
    names = (f"{', '.join(map(repr, ref))} "
             f"{'is a ref variable' if len(ref) == 1 else 'are ref variables'} (use_resource=False)")
    if compiled:
        raise TypeError(
            f"{what} needs resource variables, but {names}, which XLA cannot compile. Create "
            f"them with use_resource=True (tf.compat.v1.enable_resource_variables() does it "
            f"for every variable, tf-keras layers included), or build without XLA.")
    raise TypeError(
        f"{what} needs resource variables, but {names}, and v2 control flow is on: a v2 "
        f"tf.while_loop or tf.cond body is a function, which cannot capture a ref variable. "
        f"Either create them with use_resource=True (tf.compat.v1.enable_resource_variables() "
        f"does it for every variable), or turn v2 control flow off before building "
        f"(tf.compat.v1.disable_control_flow_v2(), or tf.compat.v1.disable_v2_behavior(), "
        f"which also makes ref variables): v1 control flow carries ref variables.")


# The name scope of _apply_if's cond. A v1 cond (disable_v2_behavior) builds its branches
# in it, so the step's slots (Adam's beta1_power) would be named "if_finite/beta1_power": the
# creation guard strips it, as it strips the step's own scopes.
_IF_FINITE = "if_finite"
_V1_CONTROL_FLOW = frozenset({"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter"})


class CreationGuard:
    """Variable creator: names variables as a single-step graph would.

    Variables made in the step (by the model, Keras layers or the optimizer) are
    created with the step's name scope stripped, so they get exactly the names of a
    single-step graph of the same model.
    """

    def __init__(self, graph):
        self.graph = graph
        self.base = graph.get_name_scope()
        self.created = []  # every variable made under this guard, in order
        self.step_prefix = None  # the step's name scope ("multistep/step/")
        self._prefix = None

    @contextlib.contextmanager
    def scope(self, sub):
        """Name scope ``sub`` of the current step, stripped from the names of variables made in it."""
        with tf.name_scope(sub) as prefix:
            self._prefix = prefix
            try:
                yield prefix
            finally:
                self._prefix = None

    def __call__(self, next_creator, **kwargs):
        name = kwargs.get("name")
        if name and self.step_prefix and name.startswith(self.step_prefix):
            # Named after a tensor of the step (an EMA's shadow of the loss): after the
            # tensor a single step would have, without the step's scopes.
            kwargs["name"] = name.split("/", self.step_prefix.count("/") + 1)[-1]
        # A caching_device (dynamic_rnn sets one) makes the variable's value a read cached
        # once per sess.run: every step after the first would reuse it. Without one, each
        # step reads the variable itself; the value read is the same, so single steps match.
        kwargs["caching_device"] = None
        current = tf.compat.v1.get_default_graph().get_name_scope()
        current = current + "/" if current else ""
        if self._prefix is None or not current.startswith(self._prefix):
            where = None  # where it is asked for
        else:
            rest = current[len(self._prefix):]
            if rest.startswith(_IF_FINITE + "/"):
                rest = rest[len(_IF_FINITE) + 1:]
            where = (self.base + "/" if self.base else "") + rest
        if where is None:
            variable = next_creator(**kwargs)
        else:
            with self.graph.name_scope(where):
                variable = next_creator(**kwargs)
        self.created.append(variable)
        return variable


def _call_loss_fn(loss_fn, args):
    loss = loss_fn(*args)
    if not isinstance(loss, tf.Tensor):
        raise TypeError(
            f"loss_fn must return a scalar float tensor, got {type(loss).__name__}.")
    if not loss.dtype.is_floating:
        raise TypeError(f"loss_fn must return a float loss, got dtype {loss.dtype.name} ({loss.name!r}).")
    if loss.shape.rank != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {loss.shape} ({loss.name!r}); "
            f"reduce it first, e.g. tf.reduce_mean(...).")
    return loss


def _trained_pairs(grads_and_vars):
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    if not pairs:
        raise ValueError("the loss has no gradient with respect to any trainable variable.")
    return pairs


def _check_gradients(grads_and_vars):
    missing = [v.name for g, v in grads_and_vars if g is None]
    if missing:
        raise ValueError(
            f"var_list: no gradient path from the loss to {', '.join(map(repr, missing))}; "
            f"remove them from var_list or use them in loss_fn.")

