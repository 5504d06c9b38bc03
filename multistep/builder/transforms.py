"""Gradient transforms: pure functions between compute and apply.

A transform maps ``(grads_and_vars, step) -> grads_and_vars``: the same
variables in the same order, each with a processed gradient (``None`` stays
``None``). ``step`` is the global step before this update, an integer tensor, or
None when there is no global step. Pass them to ``ms.unroll(...,
grad_transforms=[...])``, which applies them at every inner step, so the
optimizer's slots accumulate the *processed* gradients; or call them yourself
before ``apply_gradients``.

Sparse gradients (``tf.IndexedSlices``, from ``tf.gather`` or embedding
lookups) carry one row per lookup, so an index looked up twice arrives as two
rows. ``dedupe_sparse`` sums them per index, and every transform here sums its own
sparse input first, so every cap and norm sees the rows that will really be applied.
``ms.unroll`` gives the transforms the gradients as ``compute_gradients`` returned them,
rows unsummed, as a single step's code between compute and apply sees them: a transform
you write (``tf.clip_by_global_norm`` over the list) computes what it computes there.
"""

import numbers
import zlib

import tensorflow as tf

__all__ = ["add_noise", "apply_transform", "chain", "clip_by_global_norm", "clip_by_norm",
           "clip_by_value", "dedupe_sparse", "scale"]


def _named(name):
    def decorate(fn):
        fn.__name__ = fn.__qualname__ = name
        return fn
    return decorate


def _map(fn, grads_and_vars):
    return [(None if g is None else fn(g, v), v) for g, v in grads_and_vars]


def sum_duplicates(grad):
    """``grad`` with the rows of repeated indices summed, if it is an ``IndexedSlices``."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def _on_values(fn, grad):
    """Applies ``fn`` to a dense gradient, or to the summed rows of a sparse one."""
    if isinstance(grad, tf.IndexedSlices):
        grad = sum_duplicates(grad)
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


@_named("dedupe_sparse")
def dedupe_sparse(grads_and_vars, step=None):
    """Sums the rows of repeated indices in every ``IndexedSlices`` gradient.

    Example (index 0 looked up twice):
      >>> import tensorflow as tf, multistep as ms
      >>> g = tf.IndexedSlices(tf.constant([[3.0], [3.0]]), tf.constant([0, 0]), tf.constant([2, 1]))
      >>> [(d, _)] = ms.dedupe_sparse([(g, None)])
      >>> d.values.numpy().tolist(), d.indices.numpy().tolist()
      ([[6.0]], [0])
    """
    return _map(lambda g, v: sum_duplicates(g), grads_and_vars)


def _positive(what, value, owner):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{owner}: {what} must be a number > 0, got {value!r}.")
    return float(value)


def clip_by_value(lo, hi):
    """Clips every gradient entry to ``[lo, hi]``: ``g := min(max(g, lo), hi)``.

    Sparse rows are summed per index first, so ``hi`` caps the change of a row.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> clip = ms.clip_by_value(-1.0, 1.0)
      >>> [(g, _)] = clip([(tf.constant([-3.0, 0.5, 2.0]), None)], None)
      >>> g.numpy().tolist()
      [-1.0, 0.5, 1.0]
    """
    for what, value in (("lo", lo), ("hi", hi)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"clip_by_value: {what} must be a number, got {value!r}.")
    if lo > hi:
        raise ValueError(f"clip_by_value: lo must be <= hi, got lo={lo}, hi={hi}.")

    @_named(f"clip_by_value({lo:g}, {hi:g})")
    def transform(grads_and_vars, step=None):
        return _map(lambda g, v: _on_values(lambda x: tf.clip_by_value(x, lo, hi), g),
                    grads_and_vars)
    return transform


def clip_by_norm(max_norm):
    """Rescales each variable's gradient to L2 norm at most ``max_norm``:
    ``g := g * min(1, max_norm / ||g||)``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> [(g, _)] = ms.clip_by_norm(1.0)([(tf.constant([3.0, 4.0]), None)], None)
      >>> g.numpy().astype(float).round(6).tolist()
      [0.6, 0.8]
    """
    max_norm = _positive("max_norm", max_norm, "clip_by_norm")

    @_named(f"clip_by_norm({max_norm:g})")
    def transform(grads_and_vars, step=None):
        return _map(lambda g, v: _on_values(lambda x: tf.clip_by_norm(x, max_norm), g),
                    grads_and_vars)
    return transform


def clip_by_global_norm(max_norm):
    """Rescales all gradients together so their joint L2 norm is at most ``max_norm``:
    ``g_i := g_i * max_norm / max(||(g_1, ..., g_n)||, max_norm)``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> gvs = [(tf.constant([3.0]), None), (tf.constant([4.0]), None)]
      >>> clipped = ms.clip_by_global_norm(1.0)(gvs, None)
      >>> [g.numpy().astype(float).round(6).tolist() for g, _ in clipped]
      [[0.6], [0.8]]
    """
    max_norm = _positive("max_norm", max_norm, "clip_by_global_norm")

    @_named(f"clip_by_global_norm({max_norm:g})")
    def transform(grads_and_vars, step=None):
        grads = [None if g is None else sum_duplicates(g) for g, _ in grads_and_vars]
        present = [g for g in grads if g is not None]
        if not present:
            return list(grads_and_vars)
        clipped = iter(tf.clip_by_global_norm(present, max_norm)[0])
        return [(None if g is None else next(clipped), v)
                for g, (_, v) in zip(grads, grads_and_vars)]
    return transform


def scale(factor):
    """Multiplies every gradient by ``factor``: ``g := factor * g``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> [(g, _)] = ms.scale(0.5)([(tf.constant([2.0]), None)], None)
      >>> g.numpy().tolist()
      [1.0]
    """
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"scale: factor must be a number, got {factor!r}.")

    @_named(f"scale({factor:g})")
    def transform(grads_and_vars, step=None):
        if factor == 1:  # x * 1 is x: the gradients as they are
            return list(grads_and_vars)
        return _map(lambda g, v: _on_values(lambda x: x * tf.cast(factor, x.dtype), g),
                    grads_and_vars)
    return transform


def add_noise(stddev, *, mean=0.0, decay=0.0, seed):
    """Adds Gaussian noise: ``g := g + mean + stddev / (1 + t)^decay * n``, n ~ N(0, 1).

    ``t`` is the global step. The draw is stateless, keyed on ``(seed, t,
    variable name)``: an N-step run draws exactly the noise of N single steps,
    and a restart from a checkpoint draws the same noise again. A sparse
    gradient gets noise on its touched rows only: the same rows of the draw a
    dense gradient of that variable would get.

    The transform needs the global step ``t``: below, a constant 3.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> w = tf.Variable([0.0, 0.0], name="w")
      >>> noisy = ms.add_noise(0.1, seed=7)
      >>> a = noisy([(tf.zeros(2), w)], tf.constant(3, tf.int64))[0][0]
      >>> b = noisy([(tf.zeros(2), w)], tf.constant(3, tf.int64))[0][0]
      >>> bool(tf.reduce_all(a == b))
      True
    """
    if isinstance(stddev, bool) or not isinstance(stddev, numbers.Real) or stddev < 0:
        raise ValueError(f"add_noise: stddev must be a number >= 0, got {stddev!r}.")
    for what, value in (("mean", mean), ("decay", decay)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"add_noise: {what} must be a number, got {value!r}.")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"add_noise: seed must be an int, got {seed!r}.")
    name = f"add_noise({stddev:g}, mean={mean:g}, decay={decay:g}, seed={seed})"

    @_named(name)
    def transform(grads_and_vars, step=None):
        if step is None:
            raise ValueError(
                f"{name} keys its noise on the global step: pass global_step= to "
                f"ms.unroll, or a step tensor when calling the transform yourself.")
        step = tf.cast(step, tf.int64)
        t = tf.cast(step, tf.float32)
        sigma = stddev / tf.pow(1.0 + t, decay) if decay else tf.constant(float(stddev))

        def noisy(g, v):
            key = zlib.crc32(v.name.split(":")[0].encode()) & 0x7FFFFFFF
            draw_seed = tf.random.experimental.stateless_fold_in(
                tf.stack([tf.constant(seed, tf.int64), step]), key)
            shape = g.dense_shape if isinstance(g, tf.IndexedSlices) else tf.shape(g)
            draw = tf.random.stateless_normal(shape, draw_seed, dtype=g.dtype)
            noise = mean + tf.cast(sigma, g.dtype) * draw
            if isinstance(g, tf.IndexedSlices):
                g = sum_duplicates(g)
                return tf.IndexedSlices(g.values + tf.gather(noise, g.indices), g.indices,
                                        g.dense_shape)
            return g + noise

        return _map(noisy, grads_and_vars)
    return transform


def chain(*transforms):
    """Applies ``transforms`` in order, each to the output of the previous one.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> both = ms.chain(ms.scale(10.0), ms.clip_by_value(-1.0, 1.0))
      >>> [(g, _)] = both([(tf.constant([0.05, 0.5]), None)], None)
      >>> g.numpy().tolist()
      [0.5, 1.0]
    """
    for i, t in enumerate(transforms):
        if not callable(t):
            raise TypeError(f"chain: transform {i} must be callable "
                            f"(grads_and_vars, step) -> grads_and_vars, got {t!r}.")

    @_named("chain(" + ", ".join(_name(t) for t in transforms) + ")")
    def transform(grads_and_vars, step=None):
        for t in transforms:
            grads_and_vars = apply_transform(t, grads_and_vars, step)
        return grads_and_vars
    return transform


def _name(transform):
    return getattr(transform, "__name__", repr(transform))


def apply_transform(transform, grads_and_vars, step):
    """``transform(grads_and_vars, step)``, checked: same variables, same order, same shapes."""
    grads_and_vars = list(grads_and_vars)
    out = transform(grads_and_vars, step)
    name = _name(transform)
    try:
        out = [tuple(pair) for pair in out]
    except TypeError:
        raise TypeError(f"gradient transform {name} must return a list of (gradient, "
                        f"variable) pairs, got {type(out).__name__}.") from None
    if len(out) != len(grads_and_vars) or any(len(p) != 2 for p in out):
        raise ValueError(f"gradient transform {name} returned {len(out)} items for "
                         f"{len(grads_and_vars)} (gradient, variable) pairs; it must "
                         f"return one pair per variable, in order.")
    for (g_in, v_in), (g_out, v_out) in zip(grads_and_vars, out):
        label = getattr(v_in, "name", v_in)
        if v_out is not v_in:
            raise ValueError(f"gradient transform {name} changed the variable of pair "
                             f"{label!r} to {getattr(v_out, 'name', v_out)!r}; it may "
                             f"only change gradients.")
        if (g_in is None) != (g_out is None):
            raise ValueError(f"gradient transform {name} turned the gradient of {label!r} "
                             f"{'into' if g_out is None else 'from'} None.")
        if g_out is None:
            continue
        if not isinstance(g_out, (tf.Tensor, tf.IndexedSlices)):
            raise TypeError(f"gradient transform {name} returned a {type(g_out).__name__} "
                            f"as the gradient of {label!r}; expected a tensor.")
        if g_out.dtype.base_dtype != g_in.dtype.base_dtype:
            raise TypeError(f"gradient transform {name} changed the dtype of {label!r}'s "
                            f"gradient from {g_in.dtype.name} to {g_out.dtype.name}.")
        if isinstance(g_out, tf.Tensor) and not g_out.shape.is_compatible_with(g_in.shape):
            raise ValueError(f"gradient transform {name} changed the shape of {label!r}'s "
                             f"gradient from {g_in.shape} to {g_out.shape}.")
    return out
