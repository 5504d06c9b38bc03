"""Per-step inputs of a compiled program: the placeholders the step reads, one value a step.

Each placeholder the step reads becomes a ``[steps, ...]`` placeholder whose slice k step k
reads (``per_step_input``). ``translate`` turns what a program's loop feeds (the original
placeholders as keys, one batch a call, or a list of the N feed dicts its loop built) into
the compiled program's feed, refusing what it cannot place before any step runs.
"""

import numpy as np
import tensorflow as tf

from multistep.compiler.placement import PLACEHOLDERS

__all__ = ["per_step_input", "per_step_placeholders", "prepared", "translate"]


def per_step_input(placeholder, label):
    """The ``[steps, ...]`` placeholder that feeds ``placeholder`` one slice a step; a
    ``placeholder_with_default`` keeps its default, one value for every step.

    Left unfed (a loop that swaps only the fetch: ``sess.run(fused.train_op, {x:
    batch})``), it fails with a message that says how to feed it, rather than with
    TensorFlow's "You must feed a value for placeholder tensor 'multistep/inputs/x'"."""
    original = placeholder.outputs[0]
    shape = tf.TensorShape([None]).concatenate(original.shape)
    name = placeholder.name.replace("/", "_")
    if placeholder.type == "PlaceholderWithDefault":
        default = np.asarray(tf.get_static_value(placeholder.inputs[0]))[None]
        return tf.compat.v1.placeholder_with_default(default, shape, name=name)
    unfed = tf.debugging.Assert(False, [
        f"{label}: the compiled program reads the placeholder {original.name!r} through "
        f"{label}/inputs/{name}, one slice a step, and no value was fed to it. Feed the "
        f"compiled program through fused.run(sess, feed_dict) or fused.run(sess, "
        f"feeds=[one feed dict per step]) (the original placeholders as keys), or "
        f"sess.run(fused.train_op, fused.feed_dict(feed_dict)); a value fed to the original "
        f"placeholder reaches no compiled step."], name=f"{name}_unfed")
    with tf.control_dependencies([unfed]):
        dims = original.shape.as_list() if original.shape.rank is not None else []
        empty = tf.zeros([0] + [d or 0 for d in dims], original.dtype)
    return tf.compat.v1.placeholder_with_default(empty, shape, name=name)


def per_step_placeholders(placeholders, feeds):
    """The placeholders of ``placeholders`` that take one value a step: ``feeds`` (a nest
    of placeholders), or all of them where it is None."""
    if feeds is None:
        return placeholders
    wanted = []
    for item in tf.nest.flatten(feeds, expand_composites=True):
        op = getattr(item, "op", item)
        if not isinstance(op, tf.Operation) or op.type not in (*PLACEHOLDERS,
                                                               "PlaceholderWithDefault"):
            raise TypeError(f"ms.compile: feeds must be placeholders, got {item!r}.")
        if op not in placeholders:
            raise ValueError(f"ms.compile: feeds names {op.name!r}, which the step does not read.")
        wanted.append(op)
    return [p for p in placeholders if p in wanted]


def prepared(inputs, count, label):
    """Each per-step input as ``[count, ...]``: a value fed without the leading dimension
    (``[1, ...]``, ``translate``) broadcast to every step, else checked to hold one batch
    per step."""
    out = {}
    for original, fed in inputs.items():
        lead = tf.shape(fed, out_type=tf.int32)[0]
        check = tf.debugging.Assert(
            tf.logical_or(tf.equal(lead, count), tf.equal(lead, 1)),
            [f"{label}: the value fed to {original.name!r} must hold one batch per step "
             f"(leading dimension = the steps of the run), or be one batch for every step; "
             f"leading dimension and steps:", lead, count])
        with tf.control_dependencies([check]):
            shape = tf.concat([[count], tf.shape(fed, out_type=tf.int32)[1:]], 0)
            out[original] = tf.broadcast_to(fed, shape)
    return out


def _components(feed_dict):
    """``feed_dict`` with each composite key (a ``sparse_placeholder``'s SparseTensor) and
    its value split into their component tensors, as ``Session.run`` splits them."""
    if not any(isinstance(key, tf.SparseTensor) for key in feed_dict or ()):
        return feed_dict or {}
    out = {}
    for key, value in (feed_dict or {}).items():
        if isinstance(key, tf.SparseTensor):
            if not isinstance(value, tf.compat.v1.SparseTensorValue):
                value = tf.compat.v1.SparseTensorValue(*value)
            out.update(zip((key.indices, key.values, key.dense_shape),
                           (value.indices, value.values, value.dense_shape)))
        else:
            out[key] = value
    return out


def _name(key):
    name = key if isinstance(key, str) else getattr(key, "name", None)
    if name is not None and ":" not in name:
        name += ":0"
    return name


def translate(program, feed_dict=None, feeds=None):
    """The compiled ``program``'s feed for one run: ``feed_dict`` (the original
    placeholders, or their names, as keys; a per-step input's value ``[n, ...]``, one
    slice a step, or of the placeholder's own shape, the same every step), or ``feeds``,
    the run's single-step feed dicts in step order (one dict a step, as the program's own
    loop builds them), stacked."""
    if feeds is not None:
        if feed_dict:
            raise ValueError(f"{program.name}: give feed_dict or feeds, not both.")
        return _stacked(program, [_components(_own(program, f)) for f in feeds])
    out = {}
    for key, value in _components(_own(program, feed_dict)).items():
        fed = program._by_name.get(_name(key))  # noqa: SLF001
        if fed is None:
            out[key] = _shared(program, key, value)
            continue
        original, per_step = fed
        out[per_step] = _per_step_value(program, original, value)
    return out


def _own(program, feed_dict):
    """``feed_dict``, refused where a key is a tensor of another graph (``Session.run``
    refuses it too: "not an element of this graph"; matched by name, it would train)."""
    graph = program.train_op.graph
    for key in feed_dict or ():
        if getattr(key, "graph", graph) is not graph:
            raise ValueError(
                f"{program.name}: the feed key {key.name!r} is a tensor of another graph "
                f"than the compiled program's (a placeholder of the same name, built again "
                f"in a new graph?). Feed the placeholders of the graph the program was "
                f"compiled in.")
    return feed_dict


def _shared(program, key, value):
    """A value fed to a placeholder the steps share, to a carried tensor (step 1 starts
    from it), or to a tensor the program does not read; refused for a tensor the step
    computes: it is copied, so a value fed to the original would reach no step."""
    name = _name(key)
    if name is None or name in {t.name for t in program._finals}:  # noqa: SLF001 (carried)
        return value
    if name.split(":")[0] not in program._copied:  # noqa: SLF001
        return value
    fix = ("Feed the step's placeholders (Compiled.inputs), or make it a placeholder (or a "
           "placeholder_with_default of a constant).")
    shape = np.shape(value)
    copied = program._copied  # noqa: SLF001
    finals = [t for t in program._roots  # noqa: SLF001 (a fetched tensor fed back?)
              if isinstance(t, tf.Tensor) and t.name != name
              and t.name.split(":")[0] in copied and t.shape.is_compatible_with(shape)]
    if finals:
        fix = (f"If your loop feeds back a value the step computes (an RNN's final state, "
               f"e.g. {finals[0].name!r}), carry it: ms.compile(fetches, steps, "
               f"carry={{{name.split(':')[0]!r}: final_state}}) carries it from step to step, "
               f"and from run to run as your loop feeds it. " + fix)
    raise ValueError(
        f"{program.name}: {name!r} is computed inside the step, which the compiled program "
        f"copies: a value fed to the original would reach no step. {fix}")


def _per_step_value(program, original, value):
    value = np.asarray(value, dtype=original.dtype.as_numpy_dtype)
    rank = original.shape.rank
    if rank is None:
        if value.ndim == 0:
            return value[None]  # a scalar (keep_prob, a training switch): every step
        raise ValueError(
            f"{program.name}: {original.name!r} has no shape, so a value of shape "
            f"{value.shape} fed to it could be one batch per step or the same batch at "
            f"every step. Give the placeholder a shape (tf.compat.v1.placeholder("
            f"{original.dtype.name}, [None, ...])), or pass the run's feed dicts, one a "
            f"step: fused.run(sess, feeds=[feed_1, ..., feed_n]) (for ms.verify, the "
            f"build_fn's feed gives that list).")
    if value.ndim == rank:
        return value[None]  # the same batch at every step
    if value.ndim != rank + 1:
        raise ValueError(
            f"{program.name}: the value fed to {original.name!r} has shape "
            f"{value.shape}; the placeholder has shape {original.shape}, so feed "
            f"[steps, *{original.shape}] (one batch per step) or "
            f"{original.shape} (the same batch every step).")
    return value


def _stacked(program, feeds):
    """The run's single-step feed dicts (each as ``Session.run`` takes it), stacked: the
    per-step inputs one slice a step; a shared placeholder must be given one value."""
    if not feeds:
        raise ValueError(f"{program.name}: feeds is empty; give one feed dict per step.")
    if not 1 <= len(feeds) <= program.steps:
        raise ValueError(f"{program.name}: feeds has {len(feeds)} feed dicts; a run makes "
                         f"1..{program.steps} steps (steps={program.steps}).")
    if program.mode.startswith("unrolled") and len(feeds) != program.steps:
        raise ValueError(
            f"{program.name}: feeds has {len(feeds)} feed dicts; mode='unrolled' makes "
            f"exactly {program.steps} steps a run. Build with mode='while_loop' to run fewer.")
    named = [{_name(key): value for key, value in feed.items()} for feed in feeds]
    carried = {t.name for t in program._finals}  # noqa: SLF001 (taken from feeds[0] only)
    out = {}
    for k, feed in enumerate(named):
        if feed.keys() - carried != named[0].keys() - carried:
            raise ValueError(f"{program.name}: feeds[{k}] feeds other placeholders than "
                             f"feeds[0]; every step's feed dict must feed the same ones.")
        late = sorted((feed.keys() & carried) - named[0].keys())
        if late:
            raise ValueError(
                f"{program.name}: feeds[{k}] feeds the carried {late[0]!r}, which feeds[0] "
                f"does not: a run's first step starts from the carried value given in "
                f"feeds[0] (the later steps from the step before), so give it there.")
    for key in feeds[0]:
        name = _name(key)
        values = [feed.get(name) for feed in named]
        fed = program._by_name.get(name)  # noqa: SLF001
        if fed is None:
            value = _shared(program, key, values[0])
            if name in carried or name.split(":")[0] not in program._reads:  # noqa: SLF001
                out[key] = value  # (carried: step 1's; a placeholder the step does not read:
                continue          #  Session.run takes it and nothing reads it)
            if any(not np.array_equal(np.asarray(v), np.asarray(value)) for v in values[1:]):
                raise ValueError(
                    f"{program.name}: {name!r} is shared by the steps (fed once a run), but "
                    f"the feed dicts give it different values. List it in ms.compile(feeds="
                    f"...) to feed it one value a step.")
            out[key] = value
            continue
        original, per_step = fed
        dtype = original.dtype.as_numpy_dtype
        try:
            out[per_step] = np.stack([np.asarray(v, dtype) for v in values])
        except ValueError:
            shapes = sorted({np.shape(v) for v in values})
            raise ValueError(
                f"{program.name}: the steps' values for {name!r} have different shapes "
                f"{shapes}; one run takes one shape for every step (a short final batch, or "
                f"a sparse value with another count of entries, runs on its own: "
                f"fused.run(sess, feeds=[last_feed])).") from None
    if not program.mode.startswith("unrolled"):
        out[program._run_length.read] = len(feeds)  # noqa: SLF001 (this run's steps)
    return out


def step_feed(program, feed_dict, j):
    """Step ``j``'s single-step feed dict, from the feed dict of a compiled run (what
    ``translate`` takes): a per-step input's slice j, or its one value for every step;
    anything else as it is. ``ms.verify`` feeds the program as written with it."""
    out = {}
    for key, value in (feed_dict or {}).items():
        fed = program._by_name.get(_name(key))  # noqa: SLF001
        if fed is not None:
            rank = fed[0].shape.rank
            value = np.asarray(value)
            if (value.ndim == rank + 1) if rank is not None else value.ndim > 0:
                value = value[j]
        out[key] = value
    return out
