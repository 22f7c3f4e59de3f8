"""Shared by the kernel tests: run a test file's ``--interpret`` entry point under Triton's interpreter."""

import os
import subprocess
import sys

import pytest


@pytest.fixture
def run_interpreted():
    """Call with a test file's ``__file__``: runs ``python FILE --interpret`` with ``TRITON_INTERPRET=1``
    (the Triton kernels on CPU tensors) in a subprocess and fails the test on a non-zero exit."""

    def run(path: str, timeout_s: float = 120) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, path, "--interpret"], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    return run
