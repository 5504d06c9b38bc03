"""multistep: N real descent steps in one ``sess.run``, identical to N single steps."""

from multistep.lint import StaleForwardError
from multistep.unroll import Unrolled, unroll
from multistep.verify import Report, verify

__all__ = ["Report", "StaleForwardError", "Unrolled", "unroll", "verify"]
__version__ = "0.1.0"
