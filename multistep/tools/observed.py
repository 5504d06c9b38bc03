"""What a script's run leaves that a person sees besides its ``Session.run`` values: the
lines it prints and the files it writes under its working directory. ``multistep verify
SCRIPT.py`` runs the script as written twice and under ``multistep run`` once, each in a
copy of the working directory of its own (its largest top-level entries linked, not
copied, past COPY_LIMIT: see Plan), fed the same standard input, and compares these with
``differences``.

The rule for what may differ (documented on the command line page): a line of output
(standard output, and standard error without TensorFlow's native log lines and
multistep's own report, lines and warnings: ``script_errors``) is compared after masking
what no run repeats (hexadecimal addresses, temporary names
``tmpXXXXXXXX``, durations with a unit); beyond that, a line or a file that differs
between the two runs as written is the script's own variation and is not compared (it is
named). Checkpoints are compared by their tensors, TensorBoard event files by their
values and steps (not their wall times), a ``Saver``'s ``.meta`` by the script's own ops
(the compiled programs and random streams multistep adds to the graph left out), other
files byte for byte.
"""

import collections
import hashlib
import os
import re
import shutil

__all__ = ["COPY_LIMIT", "Plan", "differences", "files_written", "plan", "script_errors",
           "snapshot", "working_copy"]

COPY_LIMIT = 256 * 2 ** 20  # the most of a working directory each run copies
_MASKS = [(re.compile(r"0x[0-9a-fA-F]+"), "0x…"), (re.compile(r"tmp[a-z0-9_]{8}"), "tmp…"),
          (re.compile(r"\d+(\.\d+)?(e-?\d+)?\s?(ns|µs|us|ms|s|sec|secs|seconds|min)\b"),
           "…s")]


class Plan(collections.namedtuple("Plan", "folder copied linked")):
    """What each run's working copy of ``folder`` holds: the top-level entries ``copied``
    (their files compared after the run) and ``linked`` (symbolic links to the originals:
    the runs share them, and what is written there is not compared)."""


def plan(folder):
    """The Plan of ``folder``: its top-level entries, smallest first, copied while their
    files total COPY_LIMIT or less; the rest (a virtual environment, a data set) linked."""
    sized = sorted((_size(os.path.join(folder, name)), name) for name in os.listdir(folder))
    copied, linked, total = [], [], 0
    for size, name in sized:
        if total + size <= COPY_LIMIT:
            copied.append(name)
            total += size
        else:
            linked.append(name)
    return Plan(folder, sorted(copied), sorted(linked))


def _size(path):
    """The bytes of the files under ``path`` (links not followed), or just over COPY_LIMIT."""
    if os.path.islink(path) or not os.path.isdir(path):
        return 0 if os.path.islink(path) else os.path.getsize(path)
    size = 0
    for root, _, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            size += 0 if os.path.islink(file) else os.path.getsize(file)
            if size > COPY_LIMIT:
                return size
    return size


def working_copy(plan, target):
    """Makes ``target`` a working copy of ``plan.folder`` (see Plan)."""
    os.makedirs(target)
    for name in plan.copied:
        source = os.path.join(plan.folder, name)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, os.path.join(target, name), symlinks=True)
        else:
            shutil.copy2(source, os.path.join(target, name), follow_symlinks=False)
    for name in plan.linked:
        os.symlink(os.path.join(os.path.abspath(plan.folder), name), os.path.join(target, name))


def snapshot(plan):
    """{path: its bytes' digest} of the files ``plan`` copies (what ``files_written``
    compares with)."""
    return _snapshot(plan.folder, plan.copied)


def _snapshot(folder, names=None):
    out = {}
    for name in os.listdir(folder) if names is None else names:
        top = os.path.join(folder, name)
        if os.path.islink(top):
            continue
        if not os.path.isdir(top):
            out[name] = _digest(top)
            continue
        for root, _, files in os.walk(top):
            for file in files:
                path = os.path.join(root, file)
                if not os.path.islink(path):
                    out[os.path.relpath(path, folder)] = _digest(path)
    return out


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files_written(folder, before):
    """{name: what it holds} of each file under ``folder`` that is new or changed since
    ``before`` (``_snapshot`` of the folder it was copied from): a checkpoint by its
    tensors, an event file by its values, others by their bytes' digest."""
    now = _snapshot(folder)
    changed = sorted(k for k, v in now.items() if before.get(k) != v)
    out, checkpoints = {}, set()
    for name in changed:
        base = os.path.basename(name)
        if base.startswith("events.out.tfevents."):
            key = os.path.join(os.path.dirname(name), "events.out.tfevents.*")
            out[key] = out.get(key, ()) + _events(os.path.join(folder, name))
        elif name.endswith(".meta"):
            out[name] = _meta_graph(os.path.join(folder, name))
        elif name.endswith(".index") or ".data-" in base:
            checkpoints.add(re.sub(r"(\.index|\.data-\d+-of-\d+)$", "", name))
        else:
            out[name] = now[name]
    for prefix in sorted(checkpoints):
        out[prefix + " (checkpoint)"] = _tensors(os.path.join(folder, prefix))
    return out


def _events(path):
    import tensorflow as tf

    found = []
    for event in tf.compat.v1.train.summary_iterator(path):
        for value in event.summary.value:
            found.append((event.step, value.tag, value.simple_value,
                          value.tensor.SerializeToString()))
    return tuple(found)


def _meta_graph(path):
    """A ``Saver``'s MetaGraph, by the script's own ops (name and type): under ``multistep
    run`` the graph also holds the compiled programs (``deferred_k/``) and the random
    streams (``<op>_stream/``, which the rewired ops' consumers read), which the rule
    leaves out; the collections, by the names of what they hold."""
    import tensorflow as tf

    meta = tf.compat.v1.MetaGraphDef()
    with open(path, "rb") as f:
        meta.ParseFromString(f.read())
    ours = re.compile(r"^deferred_\d+/|_stream/|^multistep/")
    nodes = tuple(sorted((n.name, n.op) for n in meta.graph_def.node if not ours.search(n.name)))
    collections = tuple(sorted((k, tuple(v.node_list.value) + tuple(v.bytes_list.value))
                               for k, v in meta.collection_def.items()))
    return nodes, collections


def _tensors(prefix):
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(prefix)
    except Exception as error:  # noqa: BLE001 (a checkpoint cut short: its error is what it holds)
        return f"unreadable: {type(error).__name__}"
    return tuple((name, reader.get_tensor(name).tobytes())
                 for name in sorted(reader.get_variable_to_shape_map()))


def _lines_difference(name, lines, skipped):
    """The first line of ``name`` (a stream) that differs between the run as written and
    under multistep run, as a sentence, or None; ``lines``: the three runs' lines (the
    two as written first). Lines that differ between the runs as written are skipped
    (said in ``skipped``)."""
    varying = {i for i, (a, b) in enumerate(zip(lines[0], lines[1])) if a != b}
    if len(lines[0]) != len(lines[1]):
        skipped.append(f"{name} (its line count differs between the runs as written)")
        return None
    if varying:
        skipped.append(f"{len(varying)} line(s) of {name} that differ between the runs as "
                       f"written")
    if len(lines[2]) != len(lines[0]):
        verb = "printed" if name == "standard output" else "wrote to standard error"
        return (f"the script {verb} {len(lines[0])} lines as written and {len(lines[2])} "
                f"under multistep run (the first that differs: "
                f"{_first_unlike(lines[0], lines[2])})")
    for i, (a, b) in enumerate(zip(lines[0], lines[2])):
        if i not in varying and a != b:
            return f"line {i + 1} of its {name} differs: {a!r} as written, {b!r} under " \
                   f"multistep run"
    return None


def _first_unlike(written, fused):
    for i, (a, b) in enumerate(zip(written, fused)):
        if a != b:
            return f"line {i + 1}, {a!r} as written, {b!r} under multistep run"
    i = min(len(written), len(fused))
    return (f"line {i + 1}, " + (f"{written[i]!r} as written" if i < len(written)
                                 else f"{fused[i]!r} under multistep run"))


def _masked(line):
    for pattern, mask in _MASKS:
        line = pattern.sub(mask, line)
    return line


def script_errors(stderr):
    """The lines of a run's standard error that the rule compares: TensorFlow's native log
    lines (time stamps, thread ids: ``I0000 00:00:…``) and its start-up lines left out,
    and multistep's own: its report (``multistep deferred …`` and the indented lines
    under it), its ``multistep run: …`` lines, and its warnings (a ``…Warning:`` line
    whose message starts ``multistep`` or names a compiled program, ``deferred_N:``, and
    the indented source line under it)."""
    out, under = [], False
    for line in stderr.splitlines():
        if under and line.startswith(" "):
            continue
        under = False
        if _NATIVE_LOG.match(line) or line.startswith("multistep run:"):
            continue
        if line.startswith("multistep deferred (steps=") or _OWN_WARNING.match(line):
            under = True
            continue
        out.append(line)
    return out


_NATIVE_LOG = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ |WARNING: All log "
                         r"messages before absl::InitializeLog\(\)|To enable the following "
                         r"instructions:)")
_OWN_WARNING = re.compile(r"^.*:\d+: \w*Warning: (?:multistep|deferred_\d+:)")


def differences(first, second, fused):
    """(the first difference between the run as written and under ``multistep run`` that
    the rule compares, as a sentence, or None; what was not compared, as a list).
    Each argument: {"stdout": str, "stderr": str, "files": files_written(...)}."""
    skipped = []
    for stream, name in (("stdout", "standard output"), ("stderr", "standard error")):
        split = str.splitlines if stream == "stdout" else script_errors
        lines = [[_masked(line) for line in split(r.get(stream, ""))]
                 for r in (first, second, fused)]
        difference = _lines_difference(name, lines, skipped)
        if difference is not None:
            return difference, skipped
    files = [r["files"] for r in (first, second, fused)]
    own = sorted(k for k in set(files[0]) | set(files[1]) if files[0].get(k) != files[1].get(k))
    if own:
        skipped.append(f"files that differ between the runs as written: {', '.join(own[:3])}"
                       + (" …" if len(own) > 3 else ""))
    for name in sorted(set(files[0]) | set(files[2])):
        if name in own:
            continue
        if name not in files[2]:
            return f"the script wrote {name} as written, not under multistep run", skipped
        if name not in files[0]:
            return f"the script wrote {name} under multistep run, not as written", skipped
        if files[0][name] != files[2][name]:
            return f"the file {name} it wrote differs", skipped
    return None, skipped
