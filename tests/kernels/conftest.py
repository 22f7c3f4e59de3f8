"""Shared by the kernel tests: run a test file's ``--interpret`` entry point under Triton's interpreter."""

import pytest


@pytest.fixture
def run_interpreted(interpreter):
    """Call with a test file's ``__file__``: runs ``python FILE --interpret`` with ``TRITON_INTERPRET=1``
    (the Triton kernels on CPU tensors) in a child process of the session's interpreter server
    (``tests/interpret_server.py``: torch and Triton imported once) and fails the test on a non-zero exit."""

    def run(path: str, timeout_s: float = 120) -> None:
        returncode, output = interpreter.run(path, timeout_s=timeout_s)
        assert returncode == 0, output

    return run
