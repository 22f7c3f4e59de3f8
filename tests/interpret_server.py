"""A fork server for the Triton-interpreter checks (``python FILE --interpret ...`` with ``TRITON_INTERPRET=1``).

It imports torch, Triton (in interpreter mode: its parent sets ``TRITON_INTERPRET=1``), rayinfer's kernels and
its engine once, then runs each asked-for file as ``__main__`` in a child forked from that state: the same
code a fresh ``python FILE --interpret ...`` runs, in a process of its own (nothing one check changes reaches
the next), without the seconds of imports each fresh process spends first. ``tests/conftest.py``'s
``interpreter`` fixture starts it and talks to it.

Protocol, one request at a time: each stdin line is ``{"commands": [[path, *args], ...], "timeout_s": T}``,
command lines run at once, one child each (a child still running after T seconds is killed); the answer is
one stdout line ``{"results": [{"returncode": N, "output": "...", "timed_out": bool}, ...]}`` (each one's
stdout and stderr) when all have ended. Stdin's end stops the server.
"""

import importlib
import json
import os
import pkgutil
import runpy
import signal
import sys
import tempfile
import time
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


def wait_all(children: list[tuple[int, str]], timeout_s: float) -> list[dict]:
    """Reap every child; one still running after ``timeout_s`` is killed (it is this server's unreaped
    child, so its pid is still its own) and marked ``timed_out``."""
    deadline = time.monotonic() + timeout_s
    status: dict[int, int] = {}
    timed_out: set[int] = set()
    while len(status) < len(children):
        for pid, _ in children:
            if pid not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = code
        if len(status) < len(children) and time.monotonic() > deadline:
            for pid, _ in children:
                if pid not in status:
                    os.kill(pid, signal.SIGKILL)
                    timed_out.add(pid)
                    status[pid] = os.waitpid(pid, 0)[1]
        time.sleep(0.02)
    results = []
    for pid, out_path in children:
        with open(out_path, errors="replace") as f:
            results.append({"returncode": os.waitstatus_to_exitcode(status[pid]), "output": f.read(),
                            "timed_out": pid in timed_out})
        os.unlink(out_path)
    return results


def main() -> None:
    preload()
    answer = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        children = []
        for argv in request["commands"]:
            fd, out_path = tempfile.mkstemp(prefix="interpret-", suffix=".log")
            os.close(fd)
            answer.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                run_child(argv, out_path)
            children.append((pid, out_path))
        answer.write(json.dumps({"results": wait_all(children, request["timeout_s"])}) + "\n")
        answer.flush()


if __name__ == "__main__":
    main()
