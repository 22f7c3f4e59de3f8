"""A fork server for the Triton-interpreter checks (``python FILE --interpret ...`` with ``TRITON_INTERPRET=1``).

It imports torch, Triton (in interpreter mode: its parent sets ``TRITON_INTERPRET=1``), rayinfer's kernels and
its engine once, then runs each asked-for file as ``__main__`` in a child forked from that state: the same
code a fresh ``python FILE --interpret ...`` runs, in a process of its own (nothing one check changes reaches
the next), without the seconds of imports each fresh process spends first. ``tests/conftest.py``'s
``interpreter`` fixture starts it and talks to it.

Protocol, one request at a time: each stdin line is ``{"commands": [[path, *args], ...], "timeout_s": T,
"parallel": P}``: the command lines run one child each, at most P at once (default: all), and a child still
running T seconds after it started is killed; the answer is one stdout line ``{"results": [{"returncode": N,
"output": "...", "timed_out": bool}, ...]}`` (each one's stdout and stderr) when all have ended. Stdin's end
stops the server.
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


def run_pool(commands: list[list[str]], timeout_s: float, parallel: int) -> list[dict]:
    """Run every command line, at most ``parallel`` children at once, and reap them; a child still running
    ``timeout_s`` after it started is killed (it is this server's unreaped child, so its pid is still its
    own) and marked ``timed_out``. Returns one result per command line, in order."""
    waiting = list(enumerate(commands))
    running: dict[int, tuple[int, str, float]] = {}  # pid -> (index, output path, deadline)
    results: list[dict] = [{} for _ in commands]
    while waiting or running:
        while waiting and len(running) < max(1, parallel):
            index, argv = waiting.pop(0)
            fd, out_path = tempfile.mkstemp(prefix="interpret-", suffix=".log")
            os.close(fd)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                run_child(argv, out_path)
            running[pid] = (index, out_path, time.monotonic() + timeout_s)
        for pid, (index, out_path, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            timed_out = not done and time.monotonic() > deadline
            if timed_out:
                os.kill(pid, signal.SIGKILL)
                status = os.waitpid(pid, 0)[1]
            if done or timed_out:
                with open(out_path, errors="replace") as f:
                    results[index] = {"returncode": os.waitstatus_to_exitcode(status), "output": f.read(),
                                      "timed_out": timed_out}
                os.unlink(out_path)
                del running[pid]
        time.sleep(0.02)
    return results


def main() -> None:
    preload()
    for line in sys.stdin:
        request = json.loads(line)
        results = run_pool(request["commands"], request["timeout_s"], request.get("parallel", len(request["commands"])))
        sys.stdout.write(json.dumps({"results": results}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
