"""multistep: N real descent steps in one ``sess.run``, identical to N single steps.

The public names load on first use (PEP 562), so ``import multistep`` and the
command line's ``--help`` do not import TensorFlow; ``ms.unroll`` and the rest
import it when first touched.
"""

import importlib
import sys
import types

# Public name -> the submodule that defines it (a submodule itself maps to None).
_NAMES = {
    "GraphTooLargeError": "unroll", "InputExhaustedError": "unroll", "Unrolled": "unroll",
    "unroll": "unroll", "phase": "phases", "Compiled": "compile", "compile": "compile",
    "StepFailedError": "compile",
    "every": "every",
    "Report": "verify", "session_config": "verify", "verify": "verify",
    "RuleOptimizer": "rules",
    "StaleForwardError": "lint",
    "add_noise": "transforms", "chain": "transforms", "clip_by_global_norm": "transforms",
    "clip_by_norm": "transforms", "clip_by_value": "transforms", "dedupe_sparse": "transforms",
    "scale": "transforms",
    "distribute": None, "hooks": None, "kernels": None, "keras": None, "rules": None,
    "sampling": None, "summaries": None,
    "tf2": None,
}
__all__ = sorted(_NAMES)
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'multistep' has no attribute {name!r}")
    module = importlib.import_module(f"multistep.{_NAMES[name] or name}")
    value = module if _NAMES[name] is None else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))


class _Package(types.ModuleType):
    """The import system binds each submodule as an attribute of its package once it has
    loaded; where a public function shares its submodule's name (``unroll``, ``verify``),
    the function keeps the name, as ``from multistep.unroll import unroll`` left it."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _NAMES.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
