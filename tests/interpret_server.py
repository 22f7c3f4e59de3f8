"""A fork server for the Triton-interpreter checks (``python FILE --interpret ...`` with ``TRITON_INTERPRET=1``).

It imports torch, Triton (in interpreter mode: its parent sets ``TRITON_INTERPRET=1``), rayinfer's kernels and
its engine once, then runs each asked-for file as ``__main__`` in a child forked from that state: the same
code a fresh ``python FILE --interpret ...`` runs, in a process of its own (nothing one check changes reaches
the next), without the seconds of imports each fresh process spends first. ``tests/conftest.py``'s
``interpreter`` fixture starts it and talks to it.

Protocol, one check at a time: each stdin line is a JSON list ``[path, *args]``; the answer is one stdout line
``{"pid": N}`` when the child starts, then ``{"returncode": N, "output": "..."}`` (its stdout and stderr)
when it ends. Stdin's end stops the server.
"""

import importlib
import json
import os
import pkgutil
import runpy
import sys
import tempfile
import traceback

PRELOAD = ["numpy", "pytest", "torch", "triton", "transformers", "rayinfer.kernels", "rayinfer.engine.llm_engine"]


def preload() -> None:
    """Import what the checks import; a module that fails here is left for the check itself to report."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the child's own import raises it again, in its output
            pass
    import rayinfer.kernels

    for info in pkgutil.iter_modules(rayinfer.kernels.__path__, "rayinfer.kernels."):
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001
            pass


def run_child(argv: list[str], out_path: str) -> None:
    """In the forked child: stdout and stderr to ``out_path``, then ``argv[0]`` as ``python`` runs a script;
    exits with the code that process would."""
    fd = os.open(out_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    preload()
    answer = sys.stdout
    for line in sys.stdin:
        argv = json.loads(line)
        fd, out_path = tempfile.mkstemp(prefix="interpret-", suffix=".log")
        os.close(fd)
        answer.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(argv, out_path)
        answer.write(json.dumps({"pid": pid}) + "\n")
        answer.flush()
        _, status = os.waitpid(pid, 0)
        with open(out_path, errors="replace") as f:
            output = f.read()
        os.unlink(out_path)
        answer.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "output": output}) + "\n")
        answer.flush()


if __name__ == "__main__":
    main()
