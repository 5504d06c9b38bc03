"""TensorFlow 2 and Keras 3: N training steps in one ``tf.function`` call.

``fuse`` builds the fused call, ``check`` finds the traps in its traced loop (the
finding helpers are ``multistep.tf2.findings``), ``verify`` compares it bitwise with N
single calls; ``multistep.tf2.keras`` is ``ms.keras``.
"""

from multistep.tf2.check import check
from multistep.tf2.findings import Finding
from multistep.tf2.fuse import Fused, fuse
from multistep.tf2.verify import verify

__all__ = ["Finding", "Fused", "check", "fuse", "verify"]
