"""The checks of ``ms.unroll``'s arguments: each raises a TypeError or ValueError that
names the argument at fault and says what it takes."""

import tensorflow as tf

from multistep.builder import transforms
from multistep.builder.step import learning_rate_of

__all__ = ["as_tf_variable", "check_global_step", "check_loss_fn", "check_optimizer",
           "check_record", "check_replica_context", "check_transforms", "check_var_list"]

RECORDS = ("grad_norm", "learning_rate")


def check_replica_context(optimizer, mode, xla, nonfinite):
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
    del mode  # (loop mode compiles the replicas' steps, all-reduce included, as one body)
    refused = {"xla=True": xla, "nonfinite='skip'": nonfinite == "skip"}
    what = [option for option, given in refused.items() if given]
    if what:
        raise ValueError(
            f"ms.unroll in the replica context of {type(tf.distribute.get_strategy()).__name__}: "
            f"{what[0]} would put each step's apply inside a tf.function or tf.cond body, and "
            f"the apply all-reduces the gradients through the strategy's merge_call, which "
            f"cannot run inside a control-flow body in replica context. Use xla=False and "
            f"nonfinite='raise' or 'ignore' under a strategy (mode='unrolled' or 'while_loop').")


def check_record(record, optimizer):
    if isinstance(record, str):
        record = (record,)
    record = tuple(record)
    for name in record:
        if name not in RECORDS:
            raise ValueError(f"record: unknown quantity {name!r}; choose from {RECORDS}.")
    if "learning_rate" in record and learning_rate_of(optimizer) is None:
        raise ValueError(f"record: cannot find the learning rate of "
                         f"{type(optimizer).__name__} (no _learning_rate or _lr attribute).")
    return record


def check_loss_fn(loss_fn):
    if isinstance(loss_fn, (tf.Tensor, tf.Variable, tf.Operation)):
        raise TypeError(
            f"loss_fn must be a callable that builds the loss, got the tensor "
            f"{loss_fn.name!r}. A loss tensor built once is evaluated once per "
            f"sess.run, so every inner step would reuse the old forward pass. "
            f"Wrap the code that builds it: loss_fn=lambda: <build the loss>.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")


def check_optimizer(optimizer):
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(
            f"optimizer must be a tf.compat.v1.train.Optimizer (e.g. "
            f"tf.compat.v1.train.AdamOptimizer(1e-3)), got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}. Keras "
            f"optimizers are not supported: they manage their own step counter.")


def check_transforms(grad_transforms):
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
    return transforms.chain(*grad_transforms)


def as_tf_variable(value):
    """A tf.Variable, unwrapping Keras 3 variables (whose ``.value`` is one)."""
    if isinstance(value, tf.Variable):
        return value
    inner = getattr(value, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    return None


def check_var_list(var_list):
    if var_list is None:
        return None
    if isinstance(var_list, (tf.Variable, tf.Tensor)):
        raise TypeError("var_list must be a list of variables, got a single "
                        f"{type(var_list).__name__}; wrap it in a list.")
    out = []
    for i, value in enumerate(var_list):
        var = as_tf_variable(value)
        if var is None:
            raise TypeError(f"var_list[{i}] must be a variable, got {value!r}.")
        out.append(var)
    if not out:
        raise ValueError("var_list is empty: there is nothing to train.")
    return tuple(out)


def check_global_step(global_step):
    if global_step is None:
        return None
    var = as_tf_variable(global_step)
    if var is None or not var.dtype.base_dtype.is_integer:
        raise TypeError(
            f"global_step must be an integer variable (e.g. "
            f"tf.compat.v1.train.get_or_create_global_step()), got {global_step!r}.")
    return var
