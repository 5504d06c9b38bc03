"""The one rule of the compiler: which ops of a step N copies share and which each copy owns.

Ops that own state that outlives a step (variables, iterators, tables, queues, readers,
accumulators) are shared; placeholders become per-step inputs; everything else, the
stateful ops that use state included (reads, assigns, ``IteratorGetNext``, random ops,
summaries), is copied.
"""

import tensorflow as tf

__all__ = ["STATE_OWNERS", "STEP_RESOURCES", "placement"]

# Ops that own state that outlives a step: shared by every copy. (Placeholders are the
# step's inputs: each copy reads its own slice.)
STATE_OWNERS = frozenset({
    "VarHandleOp", "VariableV2", "Variable", "_VarHandlesOp",
    "HashTable", "HashTableV2", "MutableHashTable", "MutableHashTableV2",
    "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2", "MutableDenseHashTable",
    "MutableDenseHashTableV2", "AnonymousHashTable", "AnonymousMutableHashTable",
    "FIFOQueue", "FIFOQueueV2", "PaddingFIFOQueue", "PaddingFIFOQueueV2", "RandomShuffleQueue",
    "RandomShuffleQueueV2", "PriorityQueue", "PriorityQueueV2",
    "Iterator", "IteratorV2", "OneShotIterator", "MultiDeviceIterator",
    "AnonymousIterator", "AnonymousIteratorV2", "AnonymousIteratorV3",
    "WholeFileReader", "WholeFileReaderV2", "TextLineReader", "TextLineReaderV2",
    "FixedLengthRecordReader", "FixedLengthRecordReaderV2", "TFRecordReader",
    "TFRecordReaderV2", "IdentityReader", "IdentityReaderV2", "LMDBReader",
    "ConditionalAccumulator", "SparseConditionalAccumulator", "ResourceConditionalAccumulator",
    "Barrier", "MutexV2", "SummaryWriter", "StatsAggregator", "StatsAggregatorV2",
    "StatsAggregatorHandle", "StatsAggregatorHandleV2", "ExperimentalStatsAggregatorHandle",
    "AnonymousMutableDenseHashTable", "AnonymousMutableHashTableOfTensors",
    "AnonymousMultiDeviceIterator", "AnonymousMultiDeviceIteratorV3",
    "AnonymousMemoryCache", "DummyMemoryCache", "DummyIterationCounter",
    "AnonymousSeedGenerator", "AnonymousRandomSeedGenerator", "DummySeedGenerator",
    "ThreadPoolHandle", "ExperimentalThreadPoolHandle", "CollectiveInitializeCommunicator",
    "BoostedTreesEnsembleResourceHandleOp", "BoostedTreesQuantileStreamResourceHandleOp",
})
PLACEHOLDERS = frozenset({"Placeholder", "PlaceholderV2"})
# Ops that make a resource for the step's own use, live only while it runs, or look up
# shared state by a handle string (a feedable iterator), or store a step's value in the
# session (a session handle: a single step stores one each run): copied.
STEP_RESOURCES = frozenset({"TensorArrayV3", "TensorArrayV2", "TensorArray", "TensorArrayGrad",
                            "StackV2",
                            "Stack", "TemporaryVariable", "IteratorFromStringHandle",
                            "IteratorFromStringHandleV2", "MultiDeviceIteratorFromStringHandle",
                            "GetSessionHandle", "GetSessionHandleV2"})


def placement(op):
    """``"shared"``, ``"input"`` or ``"copied"``: what the compiler does with ``op``
    when a step's fetches reach it. Raises ``ValueError`` for an op that makes a resource
    the rule cannot place (neither known state nor a step's temporary)."""
    if op.type in STATE_OWNERS:
        return "shared"
    if op.type in PLACEHOLDERS:
        return "input"
    if op.type == "PlaceholderWithDefault" and tf.get_static_value(op.inputs[0]) is not None:
        return "input"  # (a default computed in the step: copied, and refused if fed)
    if op.type in STEP_RESOURCES:
        return "copied"
    if any(map(_is_state, op.outputs)) and not any(map(_is_state, op.inputs)):
        raise ValueError(
            f"ms.compile: the step reaches {op.name!r} ({op.type}), an op that makes state of "
            f"its own; it is neither known state to share between the steps (variables, "
            f"iterators, tables, queues, readers) nor a step's temporary to copy, so the "
            f"compiler cannot tell whether N steps should share it. Please report the op "
            f"type (tests/test_placement.py audits TensorFlow's registry); meanwhile fetch a "
            f"step that does not reach it.")
    return "copied"


def _is_state(tensor):
    return tensor.dtype == tf.resource or tensor.dtype._is_ref_dtype  # noqa: SLF001
