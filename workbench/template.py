"""A warm template for worker processes: torch is imported once per run, not once per block.

Starting ``python -m workbench.worker`` costs about 3.5 s on the CI machine before the first
step: the interpreter, torch (2 s) and torch's compiler stack (1.5 s), which every block
imports. A run of several blocks, plus the arms that need processes of their own, pays that
each time. The template is one process, started at the beginning of a run, that imports all of
it once and then forks a fresh worker for each process the run needs. It ends with the run.

Isolation is kept: every worker is still a new process with its own memory, random state and
torch state, which ends with its block; what it shares with the others is the imported code,
read-only, as after any fork. The template itself never runs a tensor operation, so no thread
pool and no CUDA context exists when it forks (it checks, and refuses to serve otherwise).

It falls back to a plain spawn (``python -m workbench.worker`` per process), and the results
say so, where forking is unsafe or unavailable: on platforms other than Linux, when the
template cannot start, or when the run asks for it (``start="spawn"``).

The protocol, over a Unix socket pair: the parent sends one JSON line per worker (its
environment and working directory) with three file descriptors attached (the worker's stdin,
its message pipe and its log); the template answers ``{"pid": N}``, and ``{"exit": N,
"code": C}`` when that worker ends, with ``C`` as ``subprocess.Popen.returncode`` gives it
(negative: killed by that signal).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

READY_TIMEOUT_S = 120.0  # importing torch cold (first run after install) takes 5-10 s here
# Imported by every block (the worker, and torch's compiler stack through FLOP counting and the
# process-state check), so importing them in the template saves each worker the time.
PRELOAD = ("torch", "workbench.worker", "torch._dynamo", "torch._inductor")


class ForkedWorker:
    """A worker forked by the template, with the parts of ``subprocess.Popen`` that process.py uses."""

    def __init__(self, pid: int, stdin, stdout, log_path: Path):
        self.pid, self.stdin, self.stdout, self.log_path = pid, stdin, stdout, log_path
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(["workbench.worker (forked)"], timeout)
        return self.returncode


class WarmTemplate:
    """The parent's handle on a running template (see the module docstring)."""

    def __init__(self, log_path: Path):
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "workbench.template", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=[theirs.fileno()],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        theirs.close()
        self._reader = self._control.makefile("rb")
        self._lock = threading.Lock()  # one spawn at a time: replies come back in order
        self._pid_reply: list[int] = []
        self._children: dict[int, ForkedWorker] = {}
        self._early_exits: dict[int, int] = {}
        self.log_path = log_path
        ready = self._read_line(READY_TIMEOUT_S)
        if ready.get("ready") is not True:
            self.close()
            raise RuntimeError(ready.get("error") or f"the template did not start (see {log_path})")
        self._replies = threading.Condition()
        threading.Thread(target=self._follow, name="workbench-template", daemon=True).start()

    def _read_line(self, timeout_s: float) -> dict:
        self._control.settimeout(timeout_s)
        try:
            line = self._reader.readline()
        except (TimeoutError, OSError) as error:
            return {"error": f"the template did not answer ({error})"}
        finally:
            self._control.settimeout(None)
        return (
            json.loads(line)
            if line
            else {"error": f"the template ended while starting (see {self.log_path})"}
        )

    def _follow(self) -> None:
        """Replies, in the background: a new worker's pid, or a worker's exit code."""
        for line in self._reader:
            reply = json.loads(line)
            with self._replies:
                if "pid" in reply:
                    self._pid_reply.append(reply["pid"])
                elif reply["exit"] in self._children:
                    self._children.pop(reply["exit"])._exited(reply["code"])
                else:  # it ended before its ForkedWorker was registered
                    self._early_exits[reply["exit"]] = reply["code"]
                self._replies.notify_all()
        with self._replies:  # the template is gone: so are its workers (they die with it)
            for child in self._children.values():
                child._exited(-signal.SIGKILL)
            self._children.clear()
            self._replies.notify_all()

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, env: dict[str, str], log_path: Path) -> ForkedWorker:
        """Fork a worker that runs ``workbench.worker.main`` with ``env``, its stderr in ``log_path``."""
        stdin_read, stdin_write = os.pipe()
        messages_read, messages_write = os.pipe()
        with self._lock, open(log_path, "wb") as log:
            request = json.dumps({"env": env, "cwd": os.getcwd()}).encode() + b"\n"
            try:
                socket.send_fds(self._control, [request], [stdin_read, messages_write, log.fileno()])
            finally:
                os.close(stdin_read)
                os.close(messages_write)
            with self._replies:
                if not self._replies.wait_for(lambda: self._pid_reply or not self.alive(), timeout=30):
                    raise RuntimeError("the template did not fork a worker within 30 s")
                if not self._pid_reply:
                    raise RuntimeError(f"the template ended (see {self.log_path})")
                pid = self._pid_reply.pop(0)
                child = ForkedWorker(
                    pid, os.fdopen(stdin_write, "wb"), os.fdopen(messages_read, "rb"), log_path
                )
                if pid in self._early_exits:
                    child._exited(self._early_exits.pop(pid))
                else:
                    self._children[pid] = child
        return child

    def close(self) -> None:
        """End the template (its idle loop ends when the socket closes; SIGKILL if it lingers)."""
        try:
            self._control.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._control.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_template(log_path: Path) -> tuple[WarmTemplate | None, str]:
    """A running template, or None and why the run's workers start as plain processes instead."""
    if not sys.platform.startswith("linux"):
        return (
            None,
            f"plain spawn: the warm template forks, which workbench does only on Linux (this is {sys.platform})",
        )
    started = time.perf_counter()
    try:
        template = WarmTemplate(log_path)
    except Exception as error:
        return None, f"plain spawn: the warm template did not start ({error})"
    return template, f"forked from a warm template (ready in {time.perf_counter() - started:.1f} s)"


# --- the template's side -----------------------------------------------------------------------


def _run_worker(request: dict, fds: list[int], control: socket.socket, in_session: int) -> None:
    """In the forked child: become a fresh worker process and never return."""
    try:
        control.close()
        os.setsid()  # its own session and process group, as the spawned workers have
        os.close(in_session)  # tells the template that killpg(pid) now reaches this process
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        # The signal handling of a new interpreter, which the template changed for itself.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from workbench import worker

        code = worker.main()
    except BaseException:  # noqa: BLE001 - whatever happens, this child must not return into the template's loop
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reap(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        control.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _check_fork_safe() -> str | None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "CUDA was initialized while importing; a forked child could not use it"
    return None


def serve(fd: int) -> int:
    """The template's loop: import once, then fork a worker per request until the socket closes."""
    control = socket.socket(fileno=fd)
    # Ctrl-C reaches the whole foreground process group; the run's process handles it and then
    # closes the template, which must not die half-way through forking meanwhile.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from workbench.worker import die_with_parent

        die_with_parent()  # it ends when the run's process dies, even by SIGKILL; its workers with it
        for module in PRELOAD:
            __import__(module)
        unsafe = _check_fork_safe()
    except Exception as error:  # noqa: BLE001 - reported to the parent, which falls back to spawn
        unsafe = f"{type(error).__name__}: {error}"
    if unsafe:
        control.sendall(json.dumps({"ready": False, "error": unsafe}).encode() + b"\n")
        return 1
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears it
    control.sendall(b'{"ready": true}\n')
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    pending, received = b"", []
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_read:
                os.read(wake_read, 512)
                _reap(control)
                continue
            data, fds, _flags, _address = socket.recv_fds(control, 1 << 16, 3)
            if not data:  # the run ended, and with it any worker still running (the parent ends them)
                os._exit(0)  # skip the interpreter's teardown of torch: nothing here needs it
            pending, received = pending + data, received + fds
            if b"\n" not in pending:
                continue  # the rest of the request is still on its way
            line, _, pending = pending.partition(b"\n")
            session_read, session_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(session_read)
                _run_worker(json.loads(line), received, control, session_write)
            for descriptor in (*received, session_write):
                os.close(descriptor)
            received = []
            os.read(session_read, 1)  # returns at the child's os.close (or death): it leads its session
            os.close(session_read)
            control.sendall(json.dumps({"pid": pid}).encode() + b"\n")


if __name__ == "__main__":
    raise SystemExit(serve(int(sys.argv[1])))
