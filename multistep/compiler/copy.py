"""The copy: a step's ops as one GraphDef (the template), imported once per copy.

``template(copied, inputs)`` takes the copied ops out of the graph as a GraphDef;
``import_copies(template, copies, roots)`` imports it as N named copies in one
``import_graph_def``, each reading its own per-step inputs, the shared state as it is,
and ordered after the copy before it.
"""

import collections

import tensorflow as tf

from multistep import graph as graph_lib

_CAST_LIKE = frozenset({"Cast", "Bitcast"})
# Ops that oneDNN's layout pass rewrites to its kernel only if it has visited their
# forward op first (it looks for the forward op's oneDNN kernel, whose workspace they
# read): in a loop body that order is the gate's to fix (``_gate``).
VISIT_ORDERED = frozenset({"MaxPoolGrad", "MaxPool3DGrad", "LRNGrad"})
# Ops of the forward pass that take a resource handle from outside the step with other
# inputs (so not an entry): a shared random stream's counter (multistep.compiler.streams).
# Their handle passes the gate too, or it would be a way into the body around it.
GATED_HANDLES = frozenset({"RngReadAndSkip"})
AT_END = "_at_end/"  # the key prefix of a fetched state's read at a copy's end

_Template = collections.namedtuple(
    "_Template",
    "graph_def names colocation shared inputs ordered rename keys entries visit_ordered at_end",
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
                     placeholders, _needs_order(copied), rename, _instance_keys(copied),
                     _entries(copied, names, placeholders), _holds_visit_ordered(copied))


def _entries(copied, names, placeholders):
    """{name: its outputs' dtypes} of each op of the step that reads state a gate cannot
    pass (``_gate``): a variable's read, a ref's read or cast, whose every input is a
    resource handle or a ref from outside the step, ordered by nothing in the step."""
    def outside(t):
        return t.op.name not in names and t.op.name not in placeholders
    return {op.name: [t.dtype.as_datatype_enum for t in op.outputs] for op in copied
            if op.inputs and op.outputs and all(outside(t) and _is_state(t) for t in op.inputs)
            and not any(c.name in names for c in op.control_inputs)
            and not any(_is_state(t) for t in op.outputs)}


def _holds_visit_ordered(copied):
    """Whether the step holds an op of ``VISIT_ORDERED``, itself or in a function it calls
    (a tf.function's body or its gradient's, a cond's branch: inlined, lowered, before
    the layout pass runs)."""
    graph = copied[0].graph if copied else None
    seen = set()

    def called(attrs):  # the functions a node's attributes name
        for attr in attrs.values():
            yield from [attr.func.name] if attr.HasField("func") else [
                f.name for f in attr.list.func]

    def holds(types_and_attrs):
        for op_type, attrs in types_and_attrs:
            if op_type in VISIT_ORDERED:
                return True
            for name in called(attrs):
                function = None if name in seen else graph._get_function(name)  # noqa: SLF001
                seen.add(name)
                if function is not None and holds(
                        (n.op, n.attr) for n in function.definition.node_def):
                    return True
        return False

    return holds((op.type, op.node_def.attr) for op in copied)


def _is_state(tensor):
    """Whether a tensor is a resource handle or a ref."""
    return tensor.dtype == tf.resource or tensor.dtype._is_ref_dtype  # noqa: SLF001


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
        ref_cast = op.type in _CAST_LIKE and graph_lib.ref_variable_of(op.inputs[0]) is not None
        if not inner or op.type in graph_lib.CALL_OPS or ref_cast:
            ordered.add(op.name)
    return ordered


def import_copies(template, copies, roots, gate=False):
    """The copies of the step, in one ``import_graph_def`` (each import walks the whole
    graph: one per copy made an unrolled build quadratic in N). ``copies``: a list of
    ``(prefix, slices, before)``: the copy's ops are ``<prefix>/<original name>``, each
    per-step placeholder reads ``slices[placeholder]``, and the ops ``_needs_order``
    names take ``before`` as a control input: None, an op, or ``"previous"`` (the end of
    the copy before it). Each copy ends with a NoOp ``<prefix>/end`` after the copies of
    the fetches. ``template.at_end``: fetched tensors of state (a variable's read, a ref) read
    again in each copy after its fetches and before its end (``AT_END`` + the tensor's
    name in the copy's dict), so that each step returns its state as of its own end.
    ``gate``: the one copy is a loop's body, entered through one node if the step holds
    an op of ``VISIT_ORDERED``, itself or in a function it calls (``_gate``).
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
        if gate and template.visit_ordered:
            _gate(graph_def.node[:len(template.names)], graph_def, prefix, order, input_map,
                  template)
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


def _gate(nodes, graph_def, prefix, order, input_map, template):
    """Makes one node, ``<prefix>/_gate`` (an IdentityN), the way into a loop body's copy:
    every value the copy takes from outside it (but a resource handle or a ref: state,
    read by the entries, ``_entries``), the entries' values and the loop's order pass
    through it.
    Why: oneDNN's layout pass visits a graph's nodes in a depth-first reverse post-order,
    which in a loop (a cycle) is a topological order only within what one node dominates;
    it rewrites MaxPoolGrad to oneDNN's kernel only if it visits the forward MaxPool
    first. Entered elsewhere (a variable's read reaching the gradients first), the body's
    order, and the kernel, depended on how edge sets hashed pointers: the convnet's body
    ran Eigen's MaxPoolGrad against the single step's oneDNN one in 3 processes of 20.
    Through the gate, every way into the copy, and every way from a step's gradients back
    to the next step's forward ops, passes one node the pass visits first. A step on
    several devices keeps its entries (one gate would move every replica's values to one
    device)."""
    devices = {tf.DeviceSpec.from_string(d).to_string() for d in
               [node.device for node in nodes] + [v.op.device for v in input_map.values()] if d}
    if len(devices) > 1:
        return
    gate = f"{prefix}/_gate"
    inputs, types, index = [], [], {}

    def through(key, source, dtype):  # the gate's output that carries source
        if key not in index:
            index[key] = len(inputs)
            if isinstance(source, tf.Tensor):  # from outside: the GraphDef names it, mapped
                input_map[f"{prefix}/_gate_in/{len(inputs)}:0"] = source
                source = f"{prefix}/_gate_in/{len(inputs)}:0"
            inputs.append(source)
            types.append(dtype)
        return f"{gate}:{index[key]}"

    entries = {template.rename(name, prefix): dtypes for name, dtypes in template.entries.items()}
    if order is not None:  # (the entries take it as they did; every other op, the gate)
        before = input_map[order]
        through(before.ref(), before, before.dtype.as_datatype_enum)
    for node in nodes:
        if node.name in entries:
            continue
        data, controls = [], []
        for reference in node.input:
            control = reference.startswith("^")
            op_name, _, port = reference.lstrip("^").partition(":")
            value = input_map.get(reference)
            if op_name in entries:
                port = int(port or 0)
                reference = through((op_name, port), f"{op_name}:{port}", entries[op_name][port])
            elif value is not None and (not _is_state(value) or node.op in GATED_HANDLES):
                reference = through(value.ref(), value, value.dtype.as_datatype_enum)
            (controls if control else data).append(
                f"^{gate}" if control and reference.startswith(f"{gate}:") else reference)
        node.input[:] = data + list(dict.fromkeys(controls))  # (no control input twice)
    node = graph_def.node.add()
    node.name, node.op, node.device = gate, "IdentityN", next(iter(devices), "")
    node.input.extend(inputs)
    node.attr["T"].list.type.extend(types)
