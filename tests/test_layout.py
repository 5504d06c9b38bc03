"""The package's layout: its parts import only downwards, and the public surface is the
documented one.

The parts, highest first (DESIGN.md, "Layout"): the tools (the command line and the
benchmark harness); the front ends and the loop around the step (``multistep.tf2``,
``multistep.verify``, ``multistep.loops``), which do not import each other; the builder;
the compiler; and at the bottom the graph walks, the bitwise comparison and the plain
data every part may read. The import graph is read from the source (every ``import``
statement, those inside functions included), not from what a run happens to load.
"""

import ast
import os
import shutil

import multistep as ms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (rank, part): a module of a higher rank may import one of a lower rank or its own part.
PARTS = {
    "multistep.graph": 0, "multistep._compare": 0, "multistep.choices": 0,
    "multistep._session_hook": 0,
    "multistep.compiler": 1,
    "multistep.builder": 2,
    "multistep.loops": 3, "multistep.tf2": 3, "multistep.verify": 3,
    "multistep.tools": 4, "multistep.__main__": 5,
}


def _part(module):
    """The part a dotted module name belongs to (its longest prefix in PARTS), or None for
    the package itself (``multistep/__init__.py`` names every part, loaded lazily)."""
    candidates = [p for p in PARTS if module == p or module.startswith(p + ".")]
    return max(candidates, key=len) if candidates else None


def _imports(path, module):
    """The ``multistep`` modules that the file ``path`` (the module ``module``) imports."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("multistep"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("multistep"):
                continue
            # "from multistep.compiler import copy" imports multistep.compiler.copy
            for alias in node.names:
                yield f"{base}.{alias.name}" if _part(f"{base}.{alias.name}") else base


def layering_violations(root):
    """Every import in the package under ``root`` that goes up a part or sideways between
    parts of one rank, as ``(importer, imported)`` pairs."""
    found = []
    for folder, _, files in os.walk(os.path.join(root, "multistep")):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            module = relative.removesuffix(".__init__")
            importer = _part(module)
            if importer is None:
                continue
            for imported in _imports(path, module):
                target = _part(imported)
                if target is None or target == importer:
                    continue
                if PARTS[target] >= PARTS[importer]:
                    found.append((module, imported))
    return found


def test_every_module_belongs_to_a_part():
    loose = []
    for folder, _, files in os.walk(os.path.join(ROOT, "multistep")):
        for name in files:
            if name.endswith(".py") and name != "__init__.py" or (
                    name == "__init__.py" and folder != os.path.join(ROOT, "multistep")):
                module = os.path.relpath(os.path.join(folder, name), ROOT)[:-3]
                module = module.replace(os.sep, ".").removesuffix(".__init__")
                if _part(module) is None:
                    loose.append(module)
    assert not loose, f"modules in no part of the layout (add them to PARTS): {loose}"


def test_imports_only_go_down():
    assert layering_violations(ROOT) == []


def test_the_layering_check_finds_a_planted_upward_import(tmp_path):
    """The check itself, on a copy of the package with an import planted in the compiler
    (from the tools above it) and one between two parts of one rank (tf2 from loops)."""
    shutil.copytree(os.path.join(ROOT, "multistep"), tmp_path / "multistep")
    with open(tmp_path / "multistep" / "compiler" / "copy.py", "a") as f:
        f.write("\n\ndef _planted():\n    from multistep.tools import cli  # noqa\n")
    with open(tmp_path / "multistep" / "loops" / "hooks.py", "a") as f:
        f.write("\nfrom multistep import tf2  # noqa\n")
    found = layering_violations(str(tmp_path))
    assert ("multistep.compiler.copy", "multistep.tools.cli") in found, found
    assert ("multistep.loops.hooks", "multistep.tf2") in found, found
    assert len(found) == 2, found


# The documented public surface: every name of ms.__all__, and the __all__ of each public
# submodule. As it was before the package was cut into parts, plus the deferred session
# (ms.deferred, ms.value) added after.
PUBLIC = {
    "": ["Compiled", "GraphTooLargeError", "InputExhaustedError", "Report", "RuleOptimizer",
         "StaleForwardError", "StepFailedError", "Unrolled", "add_noise", "chain",
         "clip_by_global_norm", "clip_by_norm", "clip_by_value", "compile", "dedupe_sparse",
         "deferred", "distribute", "every", "hooks", "keras", "kernels", "phase", "rules",
         "sampling", "scale", "session_config", "summaries", "tf2", "unroll", "value",
         "verify"],
    "distribute": ["REDUCE", "WorkerLostError", "catch_lost_worker", "set_collective_timeout",
                   "unroll"],
    "hooks": ["AutoStepsHook", "FinalOpsHook", "InputExhaustedHook", "LoggingHook", "NanHook",
              "NonFiniteLossError", "StepSummaryHook", "StopAtStepHook",
              "monitored_training_session", "steps_per_run_aware"],
    "keras": ["StepHistory"],
    "kernels": ["Kernel", "LOOP", "by_name", "compare", "count", "executed", "of_copies",
                "of_steps"],
    "rules": ["RuleOptimizer", "compact_sgd", "momentum", "sgd"],
    "sampling": ["log_uniform_candidates"],
    "summaries": ["StepSummary", "format_graph_summary", "graph_summary", "write_graph",
                  "write_run", "write_steps"],
    "tf2": ["Finding", "Fused", "check", "fuse", "verify"],
}


def test_public_surface_is_unchanged():
    assert sorted(ms.__all__) == PUBLIC[""]
    for module, names in PUBLIC.items():
        if module:
            assert sorted(getattr(ms, module).__all__) == names, module
            for name in names:
                assert getattr(getattr(ms, module), name) is not None, f"ms.{module}.{name}"
    for name in PUBLIC[""]:
        assert getattr(ms, name) is not None, f"ms.{name}"
    # the functions keep their names over the modules that share them
    assert callable(ms.verify) and callable(ms.compile) and callable(ms.unroll)
    assert callable(ms.tf2.verify) and callable(ms.tf2.check) and callable(ms.tf2.fuse)
    from multistep import hooks, tf2  # as a user imports them
    assert hooks is ms.hooks and tf2 is ms.tf2
