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

import tensorflow as tf

from multistep import lint, transforms

__all__ = ["Unrolled", "unroll"]


@dataclasses.dataclass(frozen=True)
class Unrolled:
    """The N-step program: run ``train_op`` once for N steps.

    Attributes:
      train_op: the last inner step's apply; running it runs all N steps.
      losses: float32 ``[N]``, the loss of each inner step before its apply.
        It depends on ``train_op``: fetching it (alone or with ``train_op``)
        runs the N steps exactly once.
      steps: N.
      var_list: the variables trained, in order.
      name: the name scope holding ``step_1`` ... ``step_N``.
    """

    train_op: tf.Operation
    losses: tf.Tensor
    steps: int
    var_list: tuple
    name: str


def unroll(loss_fn, optimizer, steps, *, var_list=None, inputs=None,
           grad_transforms=(), global_step=None, name="multistep"):
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
      inputs: optional tensor, or tuple/list of tensors or nests, each with
        leading dimension N; step k calls ``loss_fn(*slice_k)`` (a lone tensor
        or dict is passed as one argument).
      grad_transforms: gradient transforms ``(grads_and_vars, step) -> grads_and_vars``
        (``ms.clip_by_norm(1.0)``, ...) applied in order between compute and apply
        at every inner step, after ``ms.dedupe_sparse``; ``step`` is the global
        step before the update (None without ``global_step``).
      global_step: optional integer variable, advanced once per inner step.
      name: name scope; steps appear as
        ``name/step_k/{forward,gradients,transform,apply}``.

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
    var_list = _check_var_list(var_list)
    global_step = _check_global_step(global_step)
    transform = _check_transforms(grad_transforms)
    graph = tf.compat.v1.get_default_graph()
    guard = _CreationGuard(graph)

    with tf.name_scope(name) as scope, tf.compat.v1.variable_creator_scope(guard):
        args_for_step = _per_step_inputs(inputs, steps)
        losses, apply_op, watched = [], None, None
        for k in range(1, steps + 1):
            guard.step = k
            deps = [apply_op] if apply_op is not None else []
            with tf.name_scope(f"step_{k}"), tf.control_dependencies(deps):
                with guard.scope("forward"), _reuse_variables(k > 1):
                    loss = _call_loss_fn(loss_fn, args_for_step(k), k)
                with guard.scope("gradients"):
                    grads_and_vars = optimizer.compute_gradients(
                        loss, var_list=list(var_list) if var_list else None)
                    if var_list is None:
                        grads_and_vars = _trained_pairs(grads_and_vars)
                        var_list = tuple(v for _, v in grads_and_vars)
                    _check_gradients(grads_and_vars, k)
                if transform is not None:
                    with guard.scope("transform"):
                        step = None if global_step is None else global_step.read_value()
                        grads_and_vars = transforms.apply_transform(transform, grads_and_vars, step)
                with guard.scope("apply"), tf.control_dependencies([loss]):
                    next_apply = optimizer.apply_gradients(
                        grads_and_vars, global_step=global_step)
            if k == 1:
                state = list(var_list) + optimizer.variables()
                if global_step is not None:
                    state.append(global_step)
                watched = lint.watched_variables(state)
                lint.warn_stateful_random(next_apply, name=scope.rstrip("/"))
            else:
                lint.check_step(k, next_apply, apply_op, watched, name=scope.rstrip("/"))
            apply_op = next_apply
            losses.append(tf.cast(loss, tf.float32))
        with tf.control_dependencies([apply_op]):
            stacked = tf.stack(losses, name="losses")
    return Unrolled(train_op=apply_op, losses=stacked, steps=steps,
                    var_list=tuple(var_list), name=scope.rstrip("/"))


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
        if self.step > 1:
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


def _per_step_inputs(inputs, steps):
    """A function k -> the positional arguments of step k's loss_fn call."""
    if inputs is None:
        return lambda k: ()
    spread = type(inputs) in (tuple, list)
    flat = []
    with tf.name_scope("inputs"):
        for i, value in enumerate(tf.nest.flatten(inputs)):
            t = tf.convert_to_tensor(value)
            where = f"inputs (flattened item {i}, {t.name!r})"
            if t.shape.rank == 0:
                raise ValueError(f"{where} is a scalar; it needs a leading dimension of steps={steps}.")
            lead = t.shape[0] if t.shape.rank is not None else None
            if lead is not None and lead != steps:
                raise ValueError(
                    f"{where} has leading dimension {lead}, expected steps={steps}: "
                    f"step k takes slice k, so pass one slice per inner step.")
            if lead is None:
                check = tf.debugging.assert_equal(
                    tf.shape(t)[0], steps,
                    message=f"{where}: leading dimension must equal steps={steps}")
                with tf.control_dependencies([check]):
                    t = tf.identity(t)
            flat.append(t)

    def args(k):
        sliced = tf.nest.pack_sequence_as(inputs, [t[k - 1] for t in flat])
        return tuple(sliced) if spread else (sliced,)

    return args


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
