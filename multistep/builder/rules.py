"""Update rules as pure functions, and ``RuleOptimizer``, the optimizer that applies them.

An update rule is ``update_fn(var, grad, lr, slots, step) -> (new_var, new_slots)``:

* ``var``: the variable's current value (for a sparse gradient: its touched rows);
* ``grad``: the gradient, same shape as ``var`` (rows of repeated indices summed);
* ``lr``: the learning rate, a scalar of ``var``'s dtype (a callable learning
  rate is evaluated at every update, so schedules advance);
* ``slots``: dict slot name -> current value, same shape as ``var``;
* ``step``: the global step before this update (int64 scalar), or None when
  ``apply_gradients`` got no global step.

It returns the new value of ``var`` and a dict with the new value of every slot.
Writing rules this way needs no ``_apply_dense`` / ``_resource_apply_sparse``
cascade, and works for ref and resource variables, dense and sparse gradients.
"""

import numbers

import tensorflow as tf

from multistep.builder import transforms

__all__ = ["RuleOptimizer", "compact_sgd", "momentum", "sgd"]


class RuleOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose update is a pure function.

    Args:
      update_fn: ``(var, grad, lr, slots, step) -> (new_var, new_slots)``.
      learning_rate: a float, a tensor, or a callable returning one.
      slots: slot names (each starts at zeros, shaped like its variable), or a
        dict slot name -> initial constant.
      name: the optimizer's name; slot variables are named ``<var>/<name>/<slot>``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     w = tf.Variable([7.0, 19.5])
      ...     opt = ms.RuleOptimizer(ms.rules.compact_sgd(20.0), learning_rate=1.0)
      ...     train = opt.minimize(tf.reduce_sum(-w))   # gradient -1: w := (w + 1) mod 20
      ...     with tf.compat.v1.Session() as sess:
      ...         sess.run(tf.compat.v1.global_variables_initializer())
      ...         sess.run(train)
      ...         print(sess.run(w))
      [8.  0.5]
    """

    def __init__(self, update_fn, *, learning_rate, slots=(), use_locking=False, name="Rule"):
        if not callable(update_fn):
            raise TypeError(f"RuleOptimizer: update_fn must be callable, got {update_fn!r}.")
        if isinstance(slots, str):
            raise TypeError("RuleOptimizer: slots must be a list of names or a dict, not a string.")
        self._slot_init = dict(slots) if isinstance(slots, dict) else dict.fromkeys(slots, 0.0)
        for slot, value in self._slot_init.items():
            if not isinstance(value, numbers.Real):
                raise TypeError(f"RuleOptimizer: slot {slot!r} needs a number as initial value, got {value!r}.")
        super().__init__(use_locking, name)
        self._update_fn = update_fn
        self._learning_rate = learning_rate
        self._rule = getattr(update_fn, "__name__", repr(update_fn))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError(f"RuleOptimizer {self._rule}: no gradients to apply "
                             f"(every gradient is None).")
        with tf.init_scope():
            for _, var in pairs:
                for slot, value in self._slot_init.items():
                    self._get_or_make_slot_with_initializer(
                        var, tf.compat.v1.constant_initializer(value), var.shape,
                        var.dtype.base_dtype, slot, f"{self._name}/{slot}")
        with tf.name_scope(name or self._name):
            lr = self._call_if_callable(self._learning_rate)
            step = None if global_step is None else tf.cast(global_step.read_value(), tf.int64)
            updates = []
            for grad, var in pairs:
                with tf.name_scope("update_" + var.op.name.replace(":", "_")):
                    updates.append(self._update(grad, var, tf.cast(lr, var.dtype.base_dtype), step))
            if global_step is None:
                return tf.group(*updates, name="apply")
            with tf.control_dependencies(updates):
                return tf.compat.v1.assign_add(global_step, 1, name="apply").op

    def _update(self, grad, var, lr, step):
        slots = {name: self.get_slot(var, name) for name in self._slot_init}
        if isinstance(grad, tf.IndexedSlices):
            summed = transforms.sum_duplicates(grad)
            unique, rows = summed.indices, summed.values
            values = {name: tf.gather(slot, unique) for name, slot in slots.items()}
            new_var, new_slots = self._call_rule(var, tf.gather(var, unique), rows, lr, values, step)
            writes = [lambda: _scatter(var, unique, new_var)]
            writes += [lambda s=s, n=n: _scatter(s, unique, new_slots[n]) for n, s in slots.items()]
        else:
            values = {name: slot.read_value() for name, slot in slots.items()}
            new_var, new_slots = self._call_rule(var, var.read_value(), grad, lr, values, step)
            writes = [lambda: var.assign(new_var, use_locking=self._use_locking)]
            writes += [lambda s=s, n=n: s.assign(new_slots[n], use_locking=self._use_locking)
                       for n, s in slots.items()]
        # Every new value is computed before anything is written.
        with tf.control_dependencies([new_var, *new_slots.values()]):
            return tf.group(*[write() for write in writes])

    def _call_rule(self, var, value, grad, lr, slots, step):
        out = self._update_fn(value, grad, lr, dict(slots), step)
        where = f"RuleOptimizer {self._rule} (variable {var.op.name!r})"
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(f"{where}: update_fn must return (new_var, new_slots_dict), "
                            f"got {type(out).__name__}.")
        new_var, new_slots = out
        if set(new_slots) != set(slots):
            raise ValueError(f"{where}: update_fn returned slots {sorted(new_slots)}, "
                             f"expected {sorted(slots)}.")
        checked = {n: _check_like(f"{where}: new slot {n!r}", new_slots[n], slots[n]) for n in slots}
        return _check_like(f"{where}: new value", new_var, value), checked


def _check_like(what, new, old):
    new = tf.convert_to_tensor(new)
    if new.dtype.base_dtype != old.dtype.base_dtype:
        raise TypeError(f"{what} has dtype {new.dtype.name}, expected {old.dtype.base_dtype.name}.")
    if not new.shape.is_compatible_with(old.shape) or new.shape.rank != old.shape.rank:
        raise ValueError(f"{what} has shape {new.shape}, expected {old.shape}.")
    return new


def _scatter(var, indices, rows):
    return var.scatter_update(tf.IndexedSlices(rows, indices))


def _named(fn, name):
    fn.__name__ = fn.__qualname__ = name
    return fn


def sgd():
    """Plain gradient descent: ``w := w - lr * g``. Equal to ``GradientDescentOptimizer``.

    Examples:
      Two steps on ``w * w`` from 1 with a learning rate of 0.5: the first step's
      gradient 2 takes ``w`` to 0.

      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     w = tf.compat.v1.get_variable("w", initializer=[1.0])
      ...     opt = ms.RuleOptimizer(ms.rules.sgd(), learning_rate=0.5)
      ...     fused = ms.unroll(lambda: tf.reduce_sum(w * w), opt, 2)
      ...     with tf.compat.v1.Session() as sess:
      ...         sess.run(tf.compat.v1.global_variables_initializer())
      ...         print(sess.run(fused.losses), sess.run(w))
      [1. 0.] [0.]
    """
    def update(var, grad, lr, slots, step):
        return var - grad * lr, {}
    return _named(update, "sgd()")


def momentum(momentum, *, use_nesterov=False):
    """Heavy-ball momentum, as ``MomentumOptimizer`` computes it.

    ``a := momentum * a + g``; ``w := w - lr * a``, or with Nesterov
    ``w := w - lr * g - lr * momentum * a``. Use with ``slots=["momentum"]``.

    Examples:
      Two steps on ``w * w`` from 1: ``a`` is 2 then 0.9 * 2 + 1.6 = 3.4, so ``w``
      goes 1 -> 0.8 -> 0.46.

      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     w = tf.compat.v1.get_variable("w", initializer=[1.0])
      ...     opt = ms.RuleOptimizer(ms.rules.momentum(0.9), learning_rate=0.1,
      ...                            slots=["momentum"])
      ...     fused = ms.unroll(lambda: tf.reduce_sum(w * w), opt, 2)
      ...     with tf.compat.v1.Session() as sess:
      ...         sess.run(tf.compat.v1.global_variables_initializer())
      ...         print(sess.run(fused.losses).round(4), sess.run(w).round(4))
      [1.   0.64] [0.46]
    """
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise TypeError(f"momentum must be a number, got {momentum!r}.")

    def update(var, grad, lr, slots, step):
        accum = slots["momentum"] * momentum + grad
        if use_nesterov:
            new_var = var - (grad * lr + accum * momentum * lr)
        else:
            new_var = var - accum * lr
        return new_var, {"momentum": accum}
    return _named(update, f"momentum({momentum:g}{', nesterov' if use_nesterov else ''})")


def compact_sgd(modulus, *, noise_mean=0.0, noise_stddev=0.0, seed=0):
    """Gradient descent on a circle: ``w := floormod(w - lr * g + eps, B)``, B = ``modulus``.

    Weights stay in ``[0, B)``. ``eps ~ N(noise_mean, noise_stddev)``, drawn
    statelessly, keyed on ``(seed, global step)`` and the shape of the update,
    so fused and single steps draw the same noise; a noisy rule needs a global
    step. Use as ``ms.RuleOptimizer(ms.rules.compact_sgd(20.0), learning_rate=0.1)``.

    Examples:
      On a circle of length 2, a gradient of -3 at a learning rate of 0.5 moves ``w``
      by 1.5 a step: 0.5 -> 2.0, which is 0.0 -> 1.5.

      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     w = tf.compat.v1.get_variable("w", initializer=[0.5])
      ...     opt = ms.RuleOptimizer(ms.rules.compact_sgd(2.0), learning_rate=0.5)
      ...     fused = ms.unroll(lambda: tf.reduce_sum(-3.0 * w), opt, 2)
      ...     with tf.compat.v1.Session() as sess:
      ...         sess.run(tf.compat.v1.global_variables_initializer())
      ...         print(sess.run(fused.losses), sess.run(w))
      [-1.5 -0. ] [1.5]
    """
    if isinstance(modulus, bool) or not isinstance(modulus, numbers.Real) or not modulus > 0:
        raise ValueError(f"compact_sgd: modulus must be a number > 0, got {modulus!r}.")
    if isinstance(noise_stddev, bool) or not isinstance(noise_stddev, numbers.Real) or noise_stddev < 0:
        raise ValueError(f"compact_sgd: noise_stddev must be a number >= 0, got {noise_stddev!r}.")
    if isinstance(noise_mean, bool) or not isinstance(noise_mean, numbers.Real):
        raise TypeError(f"compact_sgd: noise_mean must be a number, got {noise_mean!r}.")
    name = f"compact_sgd({modulus:g}" + (
        f", noise_mean={noise_mean:g}, noise_stddev={noise_stddev:g}, seed={seed})"
        if noise_mean or noise_stddev else ")")

    def update(var, grad, lr, slots, step):
        stepped = var - grad * lr
        if noise_stddev:
            if step is None:
                raise ValueError(f"{name} draws noise keyed on the global step: pass "
                                 f"global_step= to ms.unroll or apply_gradients/minimize.")
            draw = tf.random.stateless_normal(
                tf.shape(var), tf.stack([tf.constant(seed, tf.int64), step]), dtype=var.dtype)
            stepped += noise_mean + noise_stddev * draw
        elif noise_mean:
            stepped += noise_mean
        return tf.math.floormod(stepped, tf.cast(modulus, var.dtype)), {}
    return _named(update, name)
