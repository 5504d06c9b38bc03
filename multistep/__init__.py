"""multistep: N real descent steps in one ``sess.run``, identical to N single steps."""

from multistep import rules, summaries
from multistep.lint import StaleForwardError
from multistep.rules import RuleOptimizer
from multistep.transforms import (add_noise, chain, clip_by_global_norm, clip_by_norm,
                                  clip_by_value, dedupe_sparse, scale)
from multistep.unroll import GraphTooLargeError, InputExhaustedError, Unrolled, unroll
from multistep.verify import Report, verify

__all__ = [
    "GraphTooLargeError", "InputExhaustedError", "Report", "RuleOptimizer", "StaleForwardError",
    "Unrolled", "add_noise", "chain", "clip_by_global_norm", "clip_by_norm", "clip_by_value",
    "dedupe_sparse", "rules", "scale", "summaries", "unroll", "verify",
]
__version__ = "0.1.0"
