"""N fused steps under a ``tf.compat.v1.distribute`` strategy.

``ms.unroll`` called in a replica context (inside
``strategy.extended.call_for_each_replica(fn)``) builds that replica's N steps.
Each step's ``apply_gradients`` all-reduces the replicas' gradients through the
optimizer's own ``merge_call``, and step k+1 of every replica starts after step k
of all of them, so a run is N single distributed steps:

    loss_k^r  = loss_fn(*inputs_k^r)                      replica r, after step k-1 of all
    grads_k^r = transforms(d loss_k^r / d var_list)        local: before the all-reduce
    apply_k   = optimizer.apply(sum_r grads_k^r)           every replica's copy, alike

``unroll(strategy, ...)`` here is the cross-replica entry point: it calls
``ms.unroll`` in every replica with that replica's per-step inputs and reduces
the replicas' losses.
"""

import tensorflow as tf

from multistep.unroll import Unrolled, positive_int
from multistep.unroll import unroll as _unroll

__all__ = ["REDUCE", "unroll"]

REDUCE = {"mean": tf.distribute.ReduceOp.MEAN, "sum": tf.distribute.ReduceOp.SUM}


def unroll(strategy, loss_fn, optimizer, steps, *, inputs=None, reduce="mean", **options):
    """``ms.unroll`` in every replica of ``strategy``; one op runs N distributed steps.

    Args:
      strategy: a ``tf.compat.v1.distribute`` strategy (``MirroredStrategy``,
        ``experimental.MultiWorkerMirroredStrategy``). Call this in its cross-replica
        context (outside ``call_for_each_replica``), in or out of ``strategy.scope()``;
        create the variables under ``strategy.scope()`` (or in ``loss_fn``'s first call).
      loss_fn, optimizer, steps: as ``ms.unroll``; ``loss_fn`` gets one replica's inputs.
      inputs: None; or a distributed iterator
        (``strategy.make_dataset_iterator(dataset)``, its initializer run): step k of
        replica r takes replica r's part of the k-th ``get_next()``; or a nest of
        per-replica values (``tf.distribute.DistributedValues``, e.g. from
        ``strategy.experimental_distribute_values_from_function``), each replica's with
        leading dimension N (step k takes slice k); or plain tensors with leading
        dimension N, the same for every replica. An iterator's N batches are taken at
        the start of the run (the data only: no step reads trained state early).
      reduce: ``"mean"`` or ``"sum"``: how ``losses`` (and ``records``) combine the
        replicas' values.
      **options: ``ms.unroll``'s keyword options (``grad_transforms``, ``global_step``,
        ``update_ops``, ``after_apply``, ``record``, ``nonfinite``, ...). Under a strategy
        ``mode`` must be ``"unrolled"``, ``xla`` False, ``nonfinite`` not ``"skip"``.
        ``grad_transforms`` see each replica's local gradient, before the all-reduce,
        as they would in a single distributed step that clips before
        ``apply_gradients``.

    Returns:
      An ``Unrolled``: ``train_op`` groups the replicas' train ops; ``losses`` is float32
      ``[N]``, each step's loss reduced across replicas; ``records`` likewise; ``var_list``
      holds the distributed variables; ``Unrolled.run`` works as for ``ms.unroll``.

    Example:
      >>> import tensorflow as tf, multistep as ms
      >>> with tf.Graph().as_default():
      ...     strategy = tf.compat.v1.distribute.MirroredStrategy(["/cpu:0"])
      ...     with strategy.scope():
      ...         w = tf.Variable(1.0)
      ...     opt = tf.compat.v1.train.GradientDescentOptimizer(0.25)
      ...     u = ms.distribute.unroll(strategy, lambda: w * w, opt, 3)
      ...     with tf.compat.v1.Session() as sess:
      ...         sess.run(tf.compat.v1.global_variables_initializer())
      ...         print(u.run(sess), sess.run(w))
      [1.       0.25     0.0625] 0.125
    """
    steps = positive_int("steps", steps)
    if reduce not in REDUCE:
        raise ValueError(f"reduce must be one of {tuple(REDUCE)}, got {reduce!r}.")
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        raise RuntimeError(
            "ms.distribute.unroll calls ms.unroll in every replica itself; call it in the "
            "cross-replica context (outside call_for_each_replica). Inside a replica "
            "function, call ms.unroll: it builds that replica's steps.")
    from_iterator = hasattr(inputs, "get_next") and hasattr(inputs, "initializer")
    if isinstance(inputs, tf.data.Dataset):
        raise TypeError(
            "inputs: pass strategy.make_dataset_iterator(dataset) (and run its "
            "initializer), so that every replica takes its part of each batch.")
    if from_iterator:
        iterator = inputs
        with tf.name_scope("inputs"):
            batches = []
            for _ in range(steps):  # in order: each get_next after the one before
                before = [t for b in batches[-1:] for x in tf.nest.flatten(b)
                          for t in strategy.experimental_local_results(x)]
                with tf.control_dependencies(before):
                    batches.append(iterator.get_next())
            inputs = batches  # per-replica values

    @tf.autograph.experimental.do_not_convert
    def replica_fn(*args):
        mine = None if not args else args[0]
        if from_iterator:  # this replica's N batches, stacked: slice k gives back batch k
            mine = tf.nest.map_structure(lambda *batches: tf.stack(batches), *mine)
        return _unroll(loss_fn, optimizer, steps, inputs=mine, **options)

    args = () if inputs is None else (inputs,)
    with strategy.scope():
        built = strategy.experimental_local_results(
            strategy.extended.call_for_each_replica(replica_fn, args=args))
        first = built[0]

        def reduced(pick):
            values = [pick(u) for u in built]
            if len(values) == 1:
                return values[0]
            return strategy.reduce(REDUCE[reduce], _per_replica(values), axis=None)

        losses = reduced(lambda u: u.losses)
        records = {key: reduced(lambda u, key=key: u.records[key]) for key in first.records}
        train_op = tf.group(*[u.train_op for u in built], name=first.name.split("/")[-1] + "_train")
    return Unrolled(train_op=train_op, losses=losses, steps=steps,
                    var_list=_distributed(first.var_list, strategy), name=first.name,
                    records=records, global_step=first.global_step)


def _per_replica(values):
    from tensorflow.python.distribute import values as values_lib  # PerReplica: no public constructor

    return values_lib.PerReplica(tuple(values))


def _distributed(var_list, strategy):
    """The distributed variables whose local copies (one replica's) ``var_list`` holds."""
    owner = {}
    for v in tf.compat.v1.global_variables():
        for local in strategy.experimental_local_results(v):
            owner[id(local)] = v
    return tuple(owner.get(id(v), v) for v in var_list)
