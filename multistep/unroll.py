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

import contextlib
import dataclasses
import numbers
import re

import tensorflow as tf

from multistep import lint, transforms
from multistep.choices import MODES

__all__ = ["GraphTooLargeError", "InputExhaustedError", "MODES", "NONFINITE", "RECORDS", "Unrolled",
           "unroll"]


@dataclasses.dataclass(frozen=True)
class Unrolled:
    """The N-step program: run ``train_op`` once for N steps.

    Attributes:
      train_op: the last inner step's apply; running it runs all N steps.
      losses: float32 ``[N]``, the loss of each inner step before its apply.
        It depends on ``train_op``: fetching it (alone or with ``train_op``)
        runs the N steps exactly once.
      records: name -> float32 ``[N]`` for each quantity asked for with
        ``record=`` (``"grad_norm"``, ``"learning_rate"``), like ``losses``.
      steps: N.
      var_list: the variables trained, in order.
      name: the name scope holding ``step_1`` ... ``step_N``.
      global_step: the global step variable, or None.
      skipped_steps: with ``nonfinite="skip"``, an int64 variable counting the
        steps skipped for non-finite values; else None.
    """

    train_op: tf.Operation
    losses: tf.Tensor
    steps: int
    var_list: tuple
    name: str
    records: dict = dataclasses.field(default_factory=dict)
    global_step: object = None
    skipped_steps: object = None

    def run(self, session, feed_dict=None):
        """Runs the N steps once; returns their losses (numpy ``[N]``).

        If a ``tf.data`` input runs out in the middle of the run, the steps
        before stay applied and ``InputExhaustedError`` says how many.
        """
        try:
            return session.run(self.losses, feed_dict)
        except tf.errors.OutOfRangeError as error:
            raise InputExhaustedError(self._exhausted_message(session, error), error) from error

    def _exhausted_message(self, session, error):
        where = re.search(rf"{re.escape(self.name)}/step_(\d+)/", getattr(error.op, "name", "") or "")
        if where:
            done = f"the first {int(where.group(1)) - 1} of its {self.steps} steps were applied"
        else:
            done = "the steps before the missing batch were applied"
        if self.global_step is not None:
            done += f"; the global step is now {session.run(self.global_step)}"
        return (f"{self.name}: the input ran out during a run: {done}. Re-initialise or "
                f"repeat the dataset, or make it a multiple of {self.steps} batches long.")


class InputExhaustedError(tf.errors.OutOfRangeError):
    """A ``tf.data`` input ran out in the middle of a fused run."""

    def __init__(self, message, error):
        super().__init__(error.node_def, error.op, message)


NONFINITE = ("raise", "skip", "ignore")
RECORDS = ("grad_norm", "learning_rate")
GRAPHDEF_LIMIT = 2 ** 31  # bytes: protobuf's limit on a serialized GraphDef


class GraphTooLargeError(ValueError):
    """An unrolled graph would pass the 2 GB GraphDef limit."""


def unroll(loss_fn, optimizer, steps, *, var_list=None, inputs=None, grad_transforms=(),
           global_step=None, mode="unrolled", xla=False, record=(), nonfinite="raise",
           name="multistep"):
    """Builds one op that performs ``steps`` real descent steps.

    Args:
      loss_fn: callable ``(*step_inputs) -> scalar float loss``. Called once per
        inner step, so it must build the forward pass (not reuse a tensor built
        outside). Variables it creates on the first call (``get_variable``,
        Keras layers) are reused on later calls.
      optimizer: a ``tf.compat.v1.train.Optimizer``; one set of slots serves all
        steps. A callable learning rate is re-evaluated at every inner step.
      steps: N >= 1.
      var_list: variables to train; default: the trainable variables the loss
        has a gradient for. Each must have a gradient path from the loss.
      inputs: optional per-step data. Tensors, or a tuple/list of tensors or
        nests, each with leading dimension N: step k calls ``loss_fn(*slice_k)``
        (a lone tensor or dict is passed as one argument). Or a
        ``tf.compat.v1.data`` iterator or dataset: each step takes the next
        element (a tuple element is spread over the arguments).
      grad_transforms: gradient transforms ``(grads_and_vars, step) -> grads_and_vars``
        (``ms.clip_by_norm(1.0)``, ...) applied in order between compute and apply
        at every inner step, after ``ms.dedupe_sparse``; ``step`` is the global
        step before the update (None without ``global_step``).
      global_step: optional integer variable, advanced once per inner step.
      mode: ``"unrolled"``: N copies of the step, chained by control
        dependencies (the graph grows with N). ``"while_loop"``: step 1, which
        creates the variables and slots, then one ``tf.while_loop`` body for
        steps 2..N (graph size independent of N; resource variables only).
      xla: compile steps 2..N with XLA (``tf.function(jit_compile=True)``).
        Results then match single steps within floating-point tolerance, not
        bitwise: XLA fuses and reorders the arithmetic.
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
      name: name scope; steps appear as
        ``name/step_k/{forward,gradients,transform,apply}`` (loop mode:
        ``name/step_1/...`` and ``name/loop/body/...``).

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
    _check_loss_fn(loss_fn)
    _check_optimizer(optimizer)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if not isinstance(xla, bool):
        raise TypeError(f"xla must be True or False, got {xla!r}.")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}.")
    step = _Step(loss_fn, optimizer, _check_var_list(var_list), _check_global_step(global_step),
                 _check_transforms(grad_transforms), _CreationGuard(tf.compat.v1.get_default_graph()),
                 _check_record(record, optimizer), nonfinite)

    with tf.name_scope(name) as scope, tf.compat.v1.variable_creator_scope(step.guard):
        label = step.label = scope.rstrip("/")
        if nonfinite == "skip":
            step.skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_steps")
        feed = _Inputs(inputs, steps, xla=xla)
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        with tf.name_scope("step_1"):
            first, apply_op = step.build(1, feed.args(0), deps=[])
        step_bytes = sum(op.node_def.ByteSize() for op in graph.get_operations()[first_op:])
        watched = lint.watched_variables(step.state())
        lint.warn_stateful_random(apply_op, name=label)
        if mode == "while_loop" and steps > 1:
            _check_resource_variables(step.state(), "mode='while_loop'")
        if mode == "unrolled" and steps > 1:
            _check_graph_size(graph, step_bytes, steps, label)

        def rest(after):
            """Steps 2..N, after the op ``after`` (None: inside a program that starts
            after step 1): ({output name: [N-1] values}, the op that ends them)."""
            if mode == "while_loop":
                return _loop(step, feed, steps, after, watched, label)
            return _chain(step, feed, steps, after, watched, label)

        if steps == 1:
            later, last = {}, apply_op
        elif xla:
            program = tf.function(lambda: rest(None)[0], jit_compile=True, autograph=False)
            with tf.control_dependencies([apply_op]):
                later = program()
            program_graph = program.get_concrete_function().graph
            lint.check_captures(program_graph, watched, name=label)
            lint.warn_random_under_xla(program_graph, name=label)
            last = next(iter(later.values())).op
        else:
            later, last = rest(apply_op)
        with tf.control_dependencies([last]):
            train_op = tf.no_op(name="train")
            outputs = {key: tf.concat([first[key][None]] + ([later[key]] if later else []), 0,
                                      name="losses" if key == "loss" else key)
                       for key in first}
    return Unrolled(train_op=train_op, losses=outputs.pop("loss"), steps=steps,
                    var_list=tuple(step.var_list), name=label, records=outputs,
                    global_step=step.global_step, skipped_steps=step.skipped)


@dataclasses.dataclass
class _Step:
    """Builds one inner step: forward, gradients, transform, checks, apply, in that order."""

    loss_fn: object
    optimizer: object
    var_list: tuple
    global_step: object
    transform: object
    guard: object
    record: tuple
    nonfinite: str
    label: str = "multistep"
    skipped: object = None

    def build(self, k, args, deps):
        """Step ``k`` (1-based; a loop body passes a tensor) after ``deps``.

        Returns ({"loss": ..., and each recorded quantity: float32 scalars}, the apply op).
        """
        self.guard.step = k if isinstance(k, int) else "2..N (the loop body)"
        tape = _tape_for(self.optimizer, self.var_list) if k != 1 else None
        with tf.control_dependencies(deps):
            with self.guard.scope("forward"), _reuse_variables(k != 1), tape or contextlib.nullcontext():
                if tape is not None:
                    tape.watch(self.var_list)
                loss = _call_loss_fn(self.loss_fn, args() if callable(args) else args, self.guard.step)
            with self.guard.scope("gradients"):
                if tape is not None:
                    grads_and_vars = list(zip(tape.gradient(loss, list(self.var_list)), self.var_list))
                if tape is None or any(g is None for g, _ in grads_and_vars):
                    # No tape, or the tape missed a variable step 1 had a gradient for: it
                    # was read outside this step (stale). tf.gradients follows that read,
                    # so the stale-forward check below can name it.
                    grads_and_vars = self.optimizer.compute_gradients(
                        loss, var_list=list(self.var_list) if self.var_list else None)
                if self.var_list is None:
                    grads_and_vars = _trained_pairs(grads_and_vars)
                    self.var_list = tuple(v for _, v in grads_and_vars)
                _check_gradients(grads_and_vars, self.guard.step)
            if self.transform is not None:
                with self.guard.scope("transform"):
                    now = None if self.global_step is None else self.global_step.read_value()
                    grads_and_vars = transforms.apply_transform(self.transform, grads_and_vars, now)
            outputs = {"loss": tf.cast(loss, tf.float32)}
            if self.record:
                with self.guard.scope("record"):
                    outputs.update(_records(self.record, self.optimizer, grads_and_vars))
            if self.nonfinite == "raise":
                with self.guard.scope("check"):
                    loss, grads_and_vars = self._checked(k, loss, grads_and_vars)
            elif self.nonfinite == "skip":
                with self.guard.scope("check"):
                    finite = _all_finite([loss] + [g for g, _ in grads_and_vars])
            with self.guard.scope("apply"), tf.control_dependencies([loss, *outputs.values()]):
                if self.nonfinite == "skip":
                    apply_op = self._apply_if(finite, grads_and_vars)
                else:
                    apply_op = self.optimizer.apply_gradients(grads_and_vars, global_step=self.global_step)
        return outputs, apply_op

    def _checked(self, k, loss, grads_and_vars):
        """The loss and gradients through CheckNumerics: a non-finite value stops the run
        before this step's apply, with a message naming the step and the variable."""
        step = f"inner step {k}" if isinstance(k, int) else "an inner step in 2..N (the loop body)"

        def check(x, what):
            message = (f"{self.label}: {step} has a non-finite {what}; that step was not "
                       f"applied, the steps before it were (nonfinite='skip' skips such steps)")
            if isinstance(x, tf.IndexedSlices):
                return tf.IndexedSlices(tf.debugging.check_numerics(x.values, message),
                                        x.indices, x.dense_shape)
            return tf.debugging.check_numerics(x, message)

        return check(loss, "loss"), [(None if g is None else check(g, f"gradient for {v.op.name!r}"), v)
                                     for g, v in grads_and_vars]

    def _apply_if(self, finite, grads_and_vars):
        """Apply when ``finite``; else only advance the global step and count the skip."""
        _check_resource_variables([v for _, v in grads_and_vars] + (
            [self.global_step] if self.global_step is not None else []), "nonfinite='skip'")

        def apply():
            with tf.control_dependencies([self.optimizer.apply_gradients(
                    grads_and_vars, global_step=self.global_step)]):
                return tf.constant(True)

        def skip():
            updates = [self.skipped.assign_add(1)]
            if self.global_step is not None:
                updates.append(self.global_step.assign_add(1))
            with tf.control_dependencies(updates):
                return tf.constant(False)

        return tf.cond(finite, apply, skip).op

    def state(self):
        """Every variable the steps write: weights, optimizer slots, global step, skip counter."""
        state = list(self.var_list) + self.optimizer.variables()
        return state + [v for v in (self.global_step, self.skipped) if v is not None]


def _tape_for(optimizer, var_list):
    """A GradientTape for steps 2..N when it computes what compute_gradients would.

    ``tf.gradients`` (inside ``compute_gradients``) walks forward from each
    variable through every op that reads it, which in an unrolled graph is every
    earlier step: building N steps costs O(N^2). A tape records this step's ops
    only. It sees resource-variable reads, so ref variables keep
    ``compute_gradients``, as does an optimizer that overrides it (loss scaling).
    """
    stock = type(optimizer).compute_gradients is tf.compat.v1.train.Optimizer.compute_gradients
    if stock and all(v.op.type == "VarHandleOp" for v in var_list):
        return tf.GradientTape(watch_accessed_variables=False)
    return None


def _chain(step, feed, steps, apply_op, watched, label):
    """Steps 2..N unrolled, each after the previous apply (step 2 after ``apply_op``)."""
    outputs = []
    for k in range(2, steps + 1):
        deps = [apply_op] if apply_op is not None else []
        with tf.name_scope(f"step_{k}"):
            out, next_apply = step.build(k, lambda k=k: feed.args(k - 1), deps=deps)
        if apply_op is not None:
            lint.check_step(k, next_apply, apply_op, watched, name=label)
        outputs.append(out)
        apply_op = next_apply
    return {key: tf.stack([out[key] for out in outputs]) for key in outputs[0]}, apply_op


def _loop(step, feed, steps, after, watched, label):
    """Steps 2..N as one ``tf.while_loop`` body; the body reads state after the previous apply."""
    bodies = []

    def body(i, arrays):
        bodies.append(tf.compat.v1.get_default_graph())
        out, apply_op = step.build(i + 1, lambda: feed.args(i), deps=[i])
        with tf.control_dependencies([apply_op]):
            return i + 1, {key: arrays[key].write(i - 1, out[key]) for key in arrays}

    keys = ["loss", *step.record]
    with tf.name_scope("loop"), tf.control_dependencies([after] if after is not None else []):
        i, arrays = tf.while_loop(
            lambda i, _: i < steps, body,
            [tf.constant(1), {key: tf.TensorArray(tf.float32, size=steps - 1) for key in keys}],
            parallel_iterations=1, maximum_iterations=steps - 1, name="body")
    lint.check_captures(bodies[0], watched, name=label)
    return {key: array.stack() for key, array in arrays.items()}, i.op


def _check_record(record, optimizer):
    if isinstance(record, str):
        record = (record,)
    record = tuple(record)
    for name in record:
        if name not in RECORDS:
            raise ValueError(f"record: unknown quantity {name!r}; choose from {RECORDS}.")
    if "learning_rate" in record and _learning_rate_of(optimizer) is None:
        raise ValueError(f"record: cannot find the learning rate of "
                         f"{type(optimizer).__name__} (no _learning_rate or _lr attribute).")
    return record


def _learning_rate_of(optimizer):
    for attr in ("_learning_rate", "_lr"):
        if hasattr(optimizer, attr):
            return getattr(optimizer, attr)
    return None


def _records(record, optimizer, grads_and_vars):
    """This step's recorded quantities, float32 scalars."""
    out = {}
    if "grad_norm" in record:
        out["grad_norm"] = tf.linalg.global_norm([g for g, _ in grads_and_vars if g is not None])
    if "learning_rate" in record:
        lr = _learning_rate_of(optimizer)
        out["learning_rate"] = tf.cast(lr() if callable(lr) else lr, tf.float32)
    return out


def _all_finite(tensors):
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors if t is not None]
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


def _check_graph_size(graph, step_bytes, steps, label):
    now = sum(op.node_def.ByteSize() for op in graph.get_operations())
    estimate = now + (steps - 1) * step_bytes
    if estimate > GRAPHDEF_LIMIT:
        raise GraphTooLargeError(
            f"{label}: {steps} unrolled steps of about {step_bytes / 2**20:.1f} MiB each "
            f"would make a GraphDef of about {estimate / 2**30:.1f} GiB, over protobuf's "
            f"2 GiB limit. Use mode='while_loop' (one step body whatever N), a smaller "
            f"N, or feed large constants through placeholders instead of embedding them.")


def _check_resource_variables(variables, what):
    ref = [v.op.name for v in variables if v.op.type != "VarHandleOp"]
    if ref:
        raise TypeError(
            f"{what} needs resource variables, but {', '.join(map(repr, ref))} "
            f"{'is a ref variable' if len(ref) == 1 else 'are ref variables'} "
            f"(use_resource=False), which a tf.while_loop or tf.cond body cannot capture. "
            f"Create them with use_resource=True (the TF2 default).")


class _CreationGuard:
    """Variable creator: names variables as a single-step graph would, once.

    Variables made during step 1 (by the model, Keras layers or the optimizer)
    are created with the step's name scope stripped, so they get exactly the
    names of a single-step graph of the same model. Making a variable in a
    later step is an error: every step must share one set of weights and slots.
    """

    def __init__(self, graph):
        self.graph = graph
        self.base = graph.get_name_scope()
        self.step = 1
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
        if self.step != 1:
            raise ValueError(
                f"loss_fn created variable {kwargs.get('name')!r} at inner step "
                f"{self.step}; variables must be created on the first call and "
                f"reused after (create Keras layers outside loss_fn, use "
                f"tf.compat.v1.get_variable, or create the variables before ms.unroll).")
        current = self.graph.get_name_scope() + "/"
        if self._prefix is None or not current.startswith(self._prefix):
            return next_creator(**kwargs)
        rest = current[len(self._prefix):]
        outer = (self.base + "/" if self.base else "") + rest
        with self.graph.name_scope(outer):
            return next_creator(**kwargs)


def _reuse_variables(reuse):
    """From step 2 on, ``get_variable`` returns the variables step 1 made."""
    if not reuse:
        return contextlib.nullcontext()
    return tf.compat.v1.variable_scope(
        tf.compat.v1.get_variable_scope(), reuse=True, auxiliary_name_scope=False)


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
    return transforms.chain(transforms.dedupe_sparse, *grad_transforms)


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


class _Inputs:
    """Step k's arguments to loss_fn: slice k of tensors, or the next element of an iterator."""

    def __init__(self, inputs, steps, *, xla):
        self.iterator, self.structure, self.flat = None, inputs, []
        if inputs is None:
            return
        if isinstance(inputs, tf.data.Dataset):
            with tf.name_scope("inputs"):
                inputs = tf.compat.v1.data.make_one_shot_iterator(inputs)
        if isinstance(inputs, tf.compat.v1.data.Iterator):
            if xla:
                raise ValueError(
                    "xla=True cannot take its steps' batches from a tf.data iterator: XLA "
                    "does not compile IteratorGetNext. Batch N steps at once instead, e.g. "
                    "inputs=tf.compat.v1.data.make_one_shot_iterator(ds.batch(N)).get_next().")
            self.iterator = inputs
            self.structure = tf.compat.v1.data.get_output_types(inputs)
            return
        with tf.name_scope("inputs"):
            for i, value in enumerate(tf.nest.flatten(inputs)):
                self.flat.append(_leading_dimension_checked(tf.convert_to_tensor(value), i, steps))

    def args(self, index):
        """Positional arguments for the step at 0-based ``index`` (an int or a scalar tensor)."""
        if self.structure is None:
            return ()
        if self.iterator is not None:
            element = self.iterator.get_next()
        else:
            element = tf.nest.pack_sequence_as(self.structure, [t[index] for t in self.flat])
        return tuple(element) if type(self.structure) in (tuple, list) else (element,)


def _leading_dimension_checked(t, i, steps):
    where = f"inputs (flattened item {i}, {t.name!r})"
    if t.shape.rank == 0:
        raise ValueError(f"{where} is a scalar; it needs a leading dimension of steps={steps}.")
    lead = t.shape[0] if t.shape.rank is not None else None
    if lead is not None and lead != steps:
        raise ValueError(
            f"{where} has leading dimension {lead}, expected steps={steps}: "
            f"step k takes slice k, so pass one slice per inner step.")
    if lead is not None:
        return t
    check = tf.debugging.assert_equal(
        tf.shape(t)[0], steps, message=f"{where}: leading dimension must equal steps={steps}")
    with tf.control_dependencies([check]):
        return tf.identity(t)


def _call_loss_fn(loss_fn, args, step):
    loss = loss_fn(*args)
    if not isinstance(loss, tf.Tensor):
        raise TypeError(
            f"loss_fn must return a scalar float tensor, got {type(loss).__name__} "
            f"at inner step {step}.")
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


def _check_gradients(grads_and_vars, step):
    missing = [v.name for g, v in grads_and_vars if g is None]
    if missing:
        raise ValueError(
            f"var_list: no gradient path from the loss to {', '.join(map(repr, missing))} "
            f"(inner step {step}); remove them from var_list or use them in loss_fn.")
