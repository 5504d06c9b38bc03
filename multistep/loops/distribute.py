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

import contextlib
import re

import tensorflow as tf

from multistep.builder.unroll import Unrolled, _per_replica, positive_int
from multistep.builder.unroll import unroll as _unroll

__all__ = ["REDUCE", "WorkerLostError", "catch_lost_worker", "set_collective_timeout", "unroll"]

REDUCE = {"mean": tf.distribute.ReduceOp.MEAN, "sum": tf.distribute.ReduceOp.SUM}


def unroll(strategy, loss_fn, optimizer, steps, *, inputs=None, reduce="mean", **options):
    """``ms.unroll`` in every replica of ``strategy``; one op runs N distributed steps.

    Args:
      strategy: a ``tf.compat.v1.distribute`` strategy (``MirroredStrategy``,
        ``experimental.MultiWorkerMirroredStrategy``). Call this in its cross-replica
        context (outside ``call_for_each_replica``), in or out of ``strategy.scope()``;
        create the variables under ``strategy.scope()`` (or in ``loss_fn``'s first call).
      loss_fn: as ``ms.unroll``'s; it gets one replica's inputs.
      optimizer: as ``ms.unroll``'s.
      steps: as ``ms.unroll``'s.
      inputs: None; or a distributed iterator
        (``strategy.make_dataset_iterator(dataset)``, its initializer run): step k of
        replica r takes replica r's part of the k-th ``get_next()``; or a nest of
        per-replica values (``tf.distribute.DistributedValues``, e.g. from
        ``strategy.experimental_distribute_values_from_function``), each replica's with
        leading dimension N (step k takes slice k); or plain tensors with leading
        dimension N, the same for every replica. An iterator's N batches are taken at
        the start of the run (the data only: no step reads trained state early), so a
        run for which fewer are left applies none of its steps, and the batches it took
        are lost: ``Unrolled.run`` then raises ``InputExhaustedError`` saying so. Make
        the dataset a multiple of N batches long (or ``repeat()`` it).
      reduce: ``"mean"`` or ``"sum"``: how ``losses`` combine the
        values of all the replicas in sync (under MultiWorkerMirroredStrategy, every
        worker's: a collective, so every worker must run the same ops).
      **options: ``ms.unroll``'s keyword options (``grad_transforms``, ``global_step``,
        ``update_ops``, ``after_apply``, ``record``, ``nonfinite``, ``mode``, ...). Under a
        strategy ``xla`` must be False and ``nonfinite`` not ``"skip"``.
        ``grad_transforms`` see each replica's local gradient, before the all-reduce,
        as they would in a single distributed step that clips before
        ``apply_gradients``.

    Returns:
      An ``Unrolled``: ``train_op`` groups the replicas' train ops; ``losses`` is float32
      ``[N]``, each step's loss reduced across replicas; ``records`` the same in every
      replica (``grad_norm``: the norm of the summed gradient the optimizer applies); ``var_list``
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
            if strategy.num_replicas_in_sync == 1:
                return values[0]  # one replica in all: nothing to reduce
            # Every replica of the cluster: under MultiWorkerMirroredStrategy this worker
            # holds only its own replicas' values, and the reduce is a collective.
            return strategy.reduce(REDUCE[reduce], _per_replica(values), axis=None)

        losses = reduced(lambda u: u.losses)
        # A record (the applied gradient's norm, the learning rate) is the same in every
        # replica: this worker's first replica's, not reduced.
        records = dict(first.records)
        # As ms.unroll's: a no-op right after the steps' ends (what the losses wait for), not
        # tf.group's per-device no-ops, so that ms.hooks tell the runs that train.
        with tf.control_dependencies([end for u in built for end in u.train_op.control_inputs]):
            train_op = tf.no_op(name=first.name.split("/")[-1] + "_train")
    return Unrolled(train_op=train_op, losses=losses, steps=steps,
                    var_list=_distributed(first.var_list, strategy), name=first.name,
                    records=records, global_step=first.global_step, summaries=first.summaries,
                    mode=first.mode, steps_per_run=first.steps_per_run,
                    _run_length=first._run_length, _batches_first=from_iterator)


def _distributed(var_list, strategy):
    """The distributed variables whose local copies (one replica's) ``var_list`` holds."""
    owner = {}
    for v in tf.compat.v1.global_variables():
        for local in strategy.experimental_local_results(v):
            owner[id(local)] = v
    return tuple(owner.get(id(v), v) for v in var_list)


def set_collective_timeout(strategy, seconds):
    """Every all-reduce ``strategy`` builds from now on fails after ``seconds``
    (``tf.errors.DeadlineExceededError``) if a peer does not take part.

    For ``tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy``, whose v1
    constructor takes no ``CommunicationOptions``: without a timeout, a worker that
    hangs, is stopped or dies while no request to it is pending leaves the others
    waiting forever (graph mode runs no health check). A dead peer with a request
    pending fails at once (``UnavailableError``), timeout or not. Call this before
    building: the optimizer's all-reduces and ``unroll``'s loss reduction take the
    timeout as they are built. Pick it well above the longest a worker may lag
    behind the others between two collectives (a checkpoint save, a slow step).
    The broadcast of the variables' initial values takes no timeout: bound that
    ``sess.run`` with ``tf.compat.v1.RunOptions(timeout_in_ms=...)``.
    Cost: TensorFlow starts a thread for every collective that has a timeout, so at
    thousands of steps a second a process can run out of threads (measured: 100 fused
    steps a run, two workers, ``std::system_error: Resource temporarily unavailable``);
    keep it for runs of modest rate, or bound the runs another way
    (``RunOptions(timeout_in_ms=...)``, a supervisor).
    Returns ``strategy``.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}.")
    extended = strategy.extended
    if not hasattr(extended, "_communication_options"):
        raise TypeError(f"{type(strategy).__name__} has no collective communication options to "
                        "time out; use MultiWorkerMirroredStrategy.")
    # The v1 strategy merges these options into every reduce it builds (tf.distribute's
    # CommunicationOptions(timeout_seconds=...), which only the v2 constructor accepts).
    extended._communication_options = extended._communication_options.merge(
        tf.distribute.experimental.CommunicationOptions(timeout_seconds=float(seconds)))
    return strategy


class WorkerLostError(RuntimeError):
    """A collective all-reduce could not complete: a peer worker died, hung or was stopped.

    ``cause`` is TensorFlow's error; ``peer`` the task it names (or None); ``timeout``
    the strategy's collective timeout in seconds (or None)."""

    def __init__(self, message, cause, peer=None, timeout=None):
        super().__init__(message)
        self.cause, self.peer, self.timeout = cause, peer, timeout


_PEER = re.compile(r"remote target (/job:[^/\s]+/replica:\d+/task:\d+)")


@contextlib.contextmanager
def catch_lost_worker(strategy=None):
    """Turns TensorFlow's errors for a lost peer in a collective into ``WorkerLostError``.

    A synchronous multi-worker step needs every worker: if one dies, the others' runs
    fail with ``UnavailableError`` (its connection reset) or, after the collective
    timeout (``set_collective_timeout``), ``DeadlineExceededError``; later runs in the
    same process fail with the first error again. Both are re-raised as one error that
    says what happened and what to do: restart every worker and restore the last
    checkpoint. Other errors pass through unchanged.

    Example::

        with ms.distribute.catch_lost_worker(strategy):
            losses = unrolled.run(sess)
    """
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.CancelledError, tf.errors.AbortedError) as error:
        text = error.message or ""
        if "ollective" not in text:  # not a collective's failure
            raise
        raise _lost(error, strategy) from error


def _lost(error, strategy):
    text = error.message or ""
    options = getattr(getattr(strategy, "extended", None), "_communication_options", None)
    timeout = getattr(options, "timeout_seconds", None) or None
    found = _PEER.search(text)
    peer = found.group(1) if found else None
    node = getattr(getattr(error, "op", None), "name", None)
    where = f" (node {node})" if node else ""
    if isinstance(error, tf.errors.DeadlineExceededError):
        what = (f"no peer took part within the collective timeout ({timeout:g} s): a worker hung, "
                f"was stopped or died" if timeout else
                "the collective timed out: a worker hung, was stopped or died")
    else:
        reason = re.search(r"grpc_message:\"([^\"]*)\"", text) or re.search(r"aborted by: (.*)", text)
        what = (f"peer {peer or 'worker'} is unreachable" + (f" ({reason.group(1)})" if reason else "")
                + ": it died or its connection was reset")
    message = (f"a collective all-reduce{where} could not complete: {what}. A synchronous "
               f"multi-worker step needs every worker, and this session cannot go on: stop every "
               f"worker, start them all again and restore the last checkpoint. "
               f"(TensorFlow: {type(error).__name__}: {_collective_line(text)})")
    return WorkerLostError(message, error, peer=peer, timeout=timeout)


def _collective_line(text):
    lines = [line.strip() for line in text.splitlines() if "ollective" in line and "node" not in line]
    return lines[0] if lines else text.strip().splitlines()[0] if text.strip() else ""
