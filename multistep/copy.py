"""The copy: a step's ops as one GraphDef (the template), imported once per copy.

``template(copied, inputs)`` takes the copied ops out of the graph as a GraphDef;
``import_copies(template, copies, roots)`` imports it as N named copies in one
``import_graph_def``, each reading its own per-step inputs, the shared state as it is,
and ordered after the copy before it.
"""

import collections

import tensorflow as tf

from multistep import lint

_CAST_LIKE = frozenset({"Cast", "Bitcast"})
AT_END = "_at_end/"  # the key prefix of a fetched state's read at a copy's end

_Template = collections.namedtuple(
    "_Template", "graph_def names colocation shared inputs ordered rename keys at_end",
    defaults=((),))  # at_end: see import_copies
# Copy k of a collective op (unrolled) takes instance key + k * _KEY_STRIDE: N copies of one
# key would meet as one collective. TensorFlow numbers a graph's keys from a counter, so
# the copies' keys stay clear of those built after; int32 keys bound the copies.
_KEY_STRIDE = 2 ** 20
MOST_KEYED_COPIES = 2 ** 31 // _KEY_STRIDE - 1


def template_of(copied, inputs, strip=None, label="", skip=frozenset()):
    """The copied ops as a GraphDef, each copy of the step made from it (``inputs``: the
    per-step placeholder ops): their colocation constraints (``_class``) taken out (set
    again after the import, pointing at the shared op itself or at the op's copy), what
    they read from outside (``shared``: a reference as the GraphDef writes it -> the
    shared tensor; ``inputs``: the names of the per-step placeholders), the ops that
    ``_needs_order`` orders after the previous step, and ``rename(name, prefix)``: an
    op's name in the copy named ``prefix`` (see ``build``'s ``strip``). Control inputs
    from the ops named in ``skip`` (an earlier compile's tripwires) are left out."""
    graph_def = tf.compat.v1.GraphDef()
    colocation = {}
    for op in copied:
        node = graph_def.node.add()
        node.CopyFrom(op.node_def)
        if skip:
            node.input[:] = [i for i in node.input if i.lstrip("^") not in skip]
        if "_class" in node.attr:
            colocation[op.name] = [s.decode() for s in node.attr["_class"].list.s]
            del node.attr["_class"]
    names = {op.name for op in copied}
    placeholders = {p.name for p in inputs}
    graph = copied[0].graph if copied else None
    shared = {}
    for node in graph_def.node:
        for reference in node.input:
            name = reference.lstrip("^").split(":")[0]
            if name in names or name in placeholders:
                continue
            if reference.startswith("^"):  # an order on a shared op: kept (a value is needed)
                shared[reference] = graph.get_operation_by_name(name).outputs[0]
            else:
                shared[reference] = graph.get_tensor_by_name(
                    reference if ":" in reference else reference + ":0")

    def rename(name, prefix):
        if strip is None:
            return f"{prefix}/{name}"
        for step_prefix, step_label in strip:
            if name.startswith(step_prefix):
                if prefix.startswith(label + "/"):  # the step's own label, as in "label/step_k"
                    prefix = step_label + prefix[len(label):]
                elif step_label != label:  # (a v2 loop body's prefix: "step")
                    prefix = f"{prefix}/{step_label}"
                return f"{prefix}/{name[len(step_prefix):]}"
        return f"{prefix}/_outside/{name}"

    return _Template(graph_def, [op.name for op in copied], colocation, shared,
                     placeholders, _needs_order(copied), rename, _instance_keys(copied))


def _instance_keys(copied):
    """{name of a node that holds a collective's instance key: "attr" (a v1 collective's
    attribute) or "const" (the constant a v2 collective takes it from)}."""
    keys = {}
    for op in copied:
        if not op.type.startswith("Collective"):
            continue
        if "instance_key" in op.node_def.attr:
            keys[op.name] = "attr"
            continue
        names = [arg.name for arg in op.op_def.input_arg]
        if "instance_key" in names:
            source = op.inputs[names.index("instance_key")].op
            if source.type != "Const":
                raise ValueError(f"ms.compile: the collective {op.name!r} takes its instance "
                                 f"key from {source.name!r} ({source.type}), not a constant: "
                                 f"its unrolled copies cannot be given keys of their own.")
            keys[source.name] = "const"
    return keys


def _needs_order(copied):
    """The ops of a copy that take the previous step's end as a control input: every op
    that nothing else in the copy orders (no input or control input from the copy),
    every function call or functional cond and loop (lowered before it runs, each op
    inside then waits only for the inputs it uses), and every cast of a ref variable
    (Grappler moves a cast ahead of the ``w/read`` alias that would order it). Ops inside
    a v1 loop of the step are reached through its ``Enter`` ops (a control edge into a
    v1 frame from outside it is invalid)."""
    members = set(copied)
    out, ordered = {}, set()  # out: the v1 frame depth of an op's outputs (0: the step's)
    for op in copied:  # creation order: inputs first, but for a v1 loop's back edges
        inner = [p for p in [t.op for t in op.inputs] + list(op.control_inputs) if p in members]
        depth = max((out[p] for p in inner if p in out), default=0)
        out[op] = depth + (op.type in ("Enter", "RefEnter")) - (op.type in ("Exit", "RefExit"))
        if depth:
            continue
        ref_cast = op.type in _CAST_LIKE and lint.ref_variable_of(op.inputs[0]) is not None
        if not inner or op.type in lint.CALL_OPS or ref_cast:
            ordered.add(op.name)
    return ordered


def import_copies(template, copies, roots):
    """The copies of the step, in one ``import_graph_def`` (each import walks the whole
    graph: one per copy made an unrolled build quadratic in N). ``copies``: a list of
    ``(prefix, slices, before)``: the copy's ops are ``<prefix>/<original name>``, each
    per-step placeholder reads ``slices[placeholder]``, and the ops ``_needs_order``
    names take ``before`` as a control input: None, an op, or ``"previous"`` (the end of
    the copy before it). Each copy ends with a NoOp ``<prefix>/end`` after the copies of
    the fetches. ``template.at_end``: fetched tensors of state (a variable's read, a ref) read
    again in each copy after its fetches and before its end (``AT_END`` + the tensor's
    name in the copy's dict), so that each step returns its state as of its own end.
    Returns ({original name: op} of each copy, the end op of each copy)."""
    graph = tf.compat.v1.get_default_graph()
    graph_def = tf.compat.v1.GraphDef()
    input_map = dict(template.shared)
    copied = set(template.names)
    fetched = [root if isinstance(root, tf.Operation) else root.op for root in roots]
    fetched = [op.name for op in fetched if op.name in copied]
    names, rename, at_end = [], template.rename, template.at_end
    for k, (prefix, slices, before) in enumerate(copies):
        linked = {}  # placeholder op name -> a tensor of this GraphDef (the copy before's)
        for original, value in slices.items():
            if isinstance(value, str):
                linked[original.op.name] = value
                continue
            input_map[f"{prefix}/_input/{original.name}"] = value
            input_map[f"^{prefix}/_input/{original.op.name}"] = value
        order = None
        if before == "previous":
            order = f"^{copies[k - 1][0]}/end"
        elif before is not None:
            order = f"^{prefix}/_before"
            input_map[order] = before.outputs[0]

        def renamed(reference):
            control = "^" if reference.startswith("^") else ""
            name = reference.lstrip("^")
            op_name = name.split(":")[0]
            if op_name in copied:
                return f"{control}{rename(name, prefix)}"
            if op_name in linked:
                return f"^{linked[op_name].split(':')[0]}" if control else linked[op_name]
            if op_name in template.inputs:
                return f"{control}{prefix}/_input/{name if ':' in name or control else name + ':0'}"
            return reference

        for source in template.graph_def.node:
            node = graph_def.node.add()
            node.CopyFrom(source)
            node.name = rename(source.name, prefix)
            node.input[:] = [renamed(i) for i in source.input]
            if order is not None and source.name in template.ordered:
                node.input.append(order)
            if k and source.name in template.keys:  # a collective: keys of its own
                if template.keys[source.name] == "attr":
                    node.attr["instance_key"].i += k * _KEY_STRIDE
                else:
                    value = tf.make_ndarray(node.attr["value"].tensor) + k * _KEY_STRIDE
                    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
            if source.op in ("Enter", "RefEnter"):  # v1 loops: a frame name per copy
                node.attr["frame_name"].s = f"{prefix}/".encode() + source.attr["frame_name"].s
            names.append(node.name)
        after = [f"^{rename(name, prefix)}" for name in fetched]
        reads = []
        for i, tensor in enumerate(at_end):
            node = graph_def.node.add()
            node.name = f"{prefix}/_at_end_{i}"
            if tensor.op.type == "ReadVariableOp":  # a read of its own, after the step
                node.op = "ReadVariableOp"
                node.input.append(renamed(tensor.op.node_def.input[0]))
                node.attr["dtype"].type = tensor.dtype.as_datatype_enum
            else:  # a ref: its value now, copied (later steps write the buffer)
                node.op = "Snapshot"
                node.input.append(renamed(tensor.name))
                node.attr["T"].type = tensor.dtype.base_dtype.as_datatype_enum
                if tensor.op.name not in copied:
                    input_map.setdefault(tensor.name, tensor)
            node.input.extend(after)
            reads.append(node.name)
        names.extend(reads)
        end = graph_def.node.add()
        end.name, end.op = f"{prefix}/end", "NoOp"
        end.input[:] = after + [f"^{r}" for r in reads]
        names.append(end.name)
    used = {i for node in graph_def.node for i in node.input}
    input_map = {k: v for k, v in input_map.items() if k in used}  # (an unused key is an error)
    if isinstance(graph, tf.__internal__.FuncGraph):  # a v2 loop body: capture what it maps
        input_map = {k: graph.capture(v) if v.graph is not graph else v
                     for k, v in input_map.items()}
    imported = tf.import_graph_def(graph_def, input_map=input_map, return_elements=names,
                                   name="")  # "": the names as written, absolute
    size = len(template.names) + len(at_end) + 1
    out, ends = [], []
    for k in range(len(copies)):
        ops = imported[k * size:(k + 1) * size]
        one = dict(zip(template.names, ops[:len(template.names)]))
        one.update((AT_END + t.name, op) for t, op in zip(at_end, ops[len(template.names):-1]))
        for name, classes in template.colocation.items():
            targets = [c[len("loc:@"):] for c in classes if c.startswith("loc:@")]
            mapped = [f"loc:@{one[t].name}" if t in one else f"loc:@{t}" for t in targets]
            one[name]._set_attr("_class", tf.compat.v1.AttrValue(  # noqa: SLF001
                list=tf.compat.v1.AttrValue.ListValue(s=[m.encode() for m in mapped])))
        out.append(one)
        ends.append(ops[-1])
    return out, ends


def state_fetches(roots, copied):
    """The fetched tensors of state that a step returns as of its end, as a single step's
    ``sess.run`` returns them: refs (a ref variable, an ``assign_add``'s ref output), and
    reads of a resource variable that nothing in the step consumes (``sess.run`` of a
    Variable makes one: unordered with the step's writes)."""
    members = set(copied)
    return [root for root in roots if isinstance(root, tf.Tensor) and (
        root.dtype._is_ref_dtype or root.op.type == "ReadVariableOp"  # noqa: SLF001
        and not any(c in members for c in root.consumers()))]


def fetched_in(copies, roots, outside):
    """The copy's counterpart of each fetch (an op or a tensor; a state fetch's read at
    the copy's end); ``outside(root)`` for a fetch the copy does not hold (a placeholder
    or a shared op)."""
    out = []
    for root in roots:
        op = root if isinstance(root, tf.Operation) else root.op
        if isinstance(root, tf.Tensor) and AT_END + root.name in copies:
            out.append(copies[AT_END + root.name].outputs[0])
        elif op.name not in copies:
            out.append(outside(root))
        elif isinstance(root, tf.Operation):
            out.append(copies[op.name])
        else:
            out.append(copies[op.name].outputs[root.value_index])
    return out
