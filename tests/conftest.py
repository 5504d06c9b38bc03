import os
import threading

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test():
    """A thread a test leaves running may sit in TensorFlow's C++ code when the interpreter
    exits, which aborts the process (exit 134) after every test has passed: the TensorBoard
    server test once did. Fail the test that leaves one, by name."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    for thread in left:
        thread.join(timeout=5)
    left = [t.name for t in left if t.is_alive()]
    assert not left, f"threads still running after the test: {left}"
