"""Shared by the kernel tests: run a test file's ``--interpret`` entry point under Triton's interpreter."""

import pytest


@pytest.fixture(scope="session")
def interpreted_checks(request, interpreter):
    """The ``--interpret`` checks of every test file in this session whose tests take ``run_interpreted``,
    run when the first of those tests asks, two at a time (both CPUs), each a child of the interpreter
    server: path -> the server's answer, which that file's test then takes and asserts on."""
    paths = list(dict.fromkeys(str(item.path) for item in request.session.items
                               if "run_interpreted" in getattr(item, "fixturenames", ())))
    return dict(zip(paths, interpreter.results([[p] for p in paths], timeout_s=120, parallel=2)))


@pytest.fixture
def run_interpreted(request, interpreter):
    """Call with a test file's ``__file__``: runs ``python FILE --interpret`` with ``TRITON_INTERPRET=1``
    (the Triton kernels on CPU tensors) in a child process of the session's interpreter server
    (``tests/interpret_server.py``: torch and Triton imported once) and fails the test on a non-zero exit.
    The session's files are run together ahead (``interpreted_checks``); each test asserts on its own."""
    def run(path: str, timeout_s: float = 120) -> None:
        checks = request.getfixturevalue("interpreted_checks")
        ahead = checks.pop(path, None)
        if ahead is not None and ahead["timeout_s"] == timeout_s:
            returncode, output = interpreter.check(ahead)
        else:  # not run ahead (or with another timeout): now, alone
            returncode, output = interpreter.run(path, timeout_s=timeout_s)
        assert returncode == 0, output

    return run
