"""``ms.tf2.verify``: N fused steps against N single calls of ``tf.function(step_fn)``,
bitwise, with the comparison the TF1 verifier uses."""

import inspect
import numbers

import numpy as np
import tensorflow as tf

from multistep._compare import Report, max_abs_diff, same_bits
from multistep.tf2.fuse import as_outputs, fuse, is_iterator

__all__ = ['verify']


def verify(step_fn, steps, *, batches, calls=3, jit_compile=False, optimizer=None, atol=0.0):
    """N fused steps against N single calls of ``tf.function(step_fn)``, bitwise.

    Builds ``fuse(step_fn, steps, jit_compile=jit_compile)`` (its first trace creates the
    variables a lazily built model makes), snapshots every variable the fused steps use
    (the model's, the optimizer's slots and iteration, metrics, random generators' state),
    runs ``calls`` fused calls, restores the snapshot, runs ``steps * calls`` calls of
    ``tf.function(step_fn, jit_compile=jit_compile)`` on the same batches, compares every
    variable after each N steps and every step's outputs, and restores the snapshot again:
    the model is left as it was.

    Args:
      step_fn: as ``fuse``'s.
      steps: as ``fuse``'s.
      jit_compile: as ``fuse``'s.
      optimizer: as ``fuse``'s.
      batches: a nest of tensors with leading dimension ``steps * calls`` (call c takes
        ``[c * steps, (c + 1) * steps)``), or a ``tf.data.Dataset`` of single batches
        (the first ``steps * calls`` elements are taken).
      calls: fused calls to compare (>= 1).
      atol: allowed max |Δ|; 0.0 asks for bitwise equality.

    Returns:
      An ``ms.Report`` (as ``ms.verify``'s): ``runs`` counts the fused calls,
      ``per_variable`` has each variable and each per-step output (``"loss"``, ...),
      ``first_divergence`` is (call, name).
    """

    if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 1:
        raise ValueError(f"calls must be an int >= 1, got {calls!r}.")
    if isinstance(atol, bool) or not isinstance(atol, numbers.Real) or not atol >= 0:
        raise ValueError(f"atol must be a number >= 0, got {atol!r}.")
    fused = fuse(step_fn, steps, jit_compile=jit_compile, check=False, optimizer=optimizer)
    total = fused.steps * calls
    if batches is None or is_iterator(batches) or inspect.isgenerator(batches):
        what = "None" if batches is None else type(batches).__name__
        raise TypeError(
            f"verify: batches must be tensors with a leading dimension of steps * calls = "
            f"{total} or a tf.data.Dataset of single batches, got {what}: verify feeds the "
            f"same batches to the fused and to the single steps, so it needs data it can "
            f"read twice. Pass the dataset itself, not iter(dataset).")
    if isinstance(batches, tf.data.Dataset):
        elements = list(batches.take(total))
        if len(elements) < total:
            raise ValueError(f"batches: the dataset has {len(elements)} elements, "
                             f"{total} needed (steps * calls).")
        batches = tf.nest.map_structure(lambda *xs: tf.stack(xs), *elements)
    batches = tf.nest.map_structure(tf.convert_to_tensor, batches)
    for t in tf.nest.flatten(batches):
        if t.shape.rank == 0 or t.shape[0] != total:
            raise ValueError(f"batches need a leading dimension of steps * calls = {total}, "
                             f"got shape {t.shape}.")

    def block(c):
        return tf.nest.map_structure(lambda t: t[c * fused.steps:(c + 1) * fused.steps], batches)

    concrete = fused._function.get_concrete_function(block(0), tf.constant(fused.steps))
    variables = _unique_names(concrete.variables)
    start = {name: tf.identity(v).numpy() for name, v in variables.items()}

    def values():
        return {name: v.numpy() for name, v in variables.items()}

    def restore():
        for name, v in variables.items():
            v.assign(start[name])

    fused_out, fused_values = [], []
    for c in range(calls):
        fused_out.append({k: v.numpy() for k, v in fused(block(c)).items()})
        fused_values.append(values())
    restore()
    single = tf.function(step_fn, jit_compile=jit_compile, autograph=False)
    single_out, single_values = [], []
    for c in range(calls):
        outs = []
        for k in range(fused.steps):
            batch = tf.nest.map_structure(lambda t: t[c * fused.steps + k], batches)
            out = as_outputs(single(*fused._arguments(batch)))
            if fused.optimizer is not None and "iteration" not in out:
                out["iteration"] = fused.optimizer.iterations
            outs.append({key: np.asarray(value) for key, value in out.items()})
        single_out.append({key: np.stack([o[key] for o in outs]) for key in outs[0]})
        single_values.append(values())
    restore()

    per_variable, first, bitwise = {}, None, True
    for c in range(calls):
        pairs = [(n, fused_values[c][n], single_values[c][n]) for n in variables]
        pairs += [(key, fused_out[c][key], single_out[c][key].astype(fused_out[c][key].dtype))
                  for key in fused_out[c]]
        for name, a, b in pairs:
            name = "losses" if name == "loss" else name  # as ms.verify names them
            diff = max_abs_diff(a, b)
            bitwise = bitwise and same_bits(a, b)
            per_variable[name] = max(per_variable.get(name, 0.0), diff)
            if first is None and not diff <= atol:
                first = (c + 1, name)
    return Report(steps=fused.steps, runs=calls, atol=float(atol), per_variable=per_variable,
                  first_divergence=first, bitwise=bitwise,
                  fused_losses=_losses(fused_out), single_losses=_losses(single_out),
                  final_values=fused_values[-1], xla=jit_compile,
                  plain_max_abs_diff=None)


def _losses(outs):
    """Each step's ``"loss"`` over the calls' outputs; empty for a step without one."""
    return np.concatenate([o.get("loss", np.zeros([0], np.float32)) for o in outs])


def _unique_names(variables):
    """name -> variable, the names made unique (Keras 3 names a layer's kernel 'kernel')."""
    out = {}
    for v in variables:
        name = getattr(v, "path", None) or v.name.split(":")[0]
        unique, n = name, 1
        while unique in out:
            n += 1
            unique = f"{name}#{n}"
        out[unique] = v
    return out
