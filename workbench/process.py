"""Run one UnitSpec in a fresh process (see workbench.worker) and collect its answer.

The child runs in its own session (process group), so that a timeout, a Stop or Ctrl-C
can end it together with its DataLoader workers, leaving no orphans. Its messages are
JSON lines; its log (stderr and prints) goes to a file whose tail explains a crash.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

KILL_GRACE_S = 3.0
POLL_S = 0.5


class Interrupted(Exception):
    """The run was stopped (Stop button or Ctrl-C) while a unit was in flight."""


def _serialize(spec) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(spec)
    except Exception as error:
        raise ValueError(
            f"the model, data or loss function cannot be sent to the arm's process ({error}); "
            "pass a zero-argument callable that builds it instead of the object itself"
        ) from error


def _end_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the child's whole process group; SIGKILL it if it has not exited in time."""
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait(timeout=KILL_GRACE_S)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_in_fresh_process(
    spec,
    *,
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
    on_message: Callable[[dict], None] = lambda message: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict:
    """Run ``spec`` in ``python -m workbench.worker``; return its result or error message (a dict).

    The returned dict has ``type`` ``"result"`` (the measurements) or ``"error"`` (with
    ``status`` ``failed`` or ``oom`` and a one-line ``reason``). Raises Interrupted when
    ``should_stop()`` turns true or on KeyboardInterrupt, after ending the child.
    """
    payload = _serialize(spec)
    header = json.dumps({"sys_path": sys.path}).encode() + b"\n"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "workbench.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
    messages: queue.Queue = queue.Queue()

    def read_messages() -> None:
        for line in process.stdout:
            try:
                messages.put(json.loads(line))
            except json.JSONDecodeError:
                continue  # not ours: the message channel only carries JSON lines
        messages.put(None)

    reader = threading.Thread(target=read_messages, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    answer: dict | None = None
    stopped = False  # True when we end the child ourselves: timeout, Stop or Ctrl-C
    try:
        try:
            process.stdin.write(header + payload)
            process.stdin.close()
        except BrokenPipeError:
            pass  # the child died while starting; its exit code and log say why
        while True:
            if should_stop():
                stopped = True
                raise Interrupted
            if time.monotonic() > deadline:
                stopped = True
                answer = {
                    "type": "error",
                    "status": "failed",
                    "reason": f"timed out after {timeout_s:.0f} s (timeout_s); the arm's process was ended",
                }
                break
            try:
                # Waiting blocks; the timeout only bounds how late a Stop or a timeout is noticed,
                # and waking rarely keeps this process off the cores the arm is measured on.
                message = messages.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if message is None:
                break
            if message.get("type") in ("result", "error"):
                answer = message
            else:
                on_message(message)
    except KeyboardInterrupt:
        stopped = True
        raise Interrupted from None
    finally:
        if not stopped:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stopped = True
        if stopped:
            _end_process_group(process)
        _signal_group(process, signal.SIGKILL)  # no DataLoader worker outlives its arm
        reader.join(timeout=5)
    if answer is not None:
        return answer
    code = process.returncode
    tail = _log_tail(log_path)
    if code == -signal.SIGKILL:
        return {
            "type": "error",
            "status": "oom",
            "reason": "the arm's process was killed by SIGKILL, which on Linux usually means the "
            "kernel's out-of-memory killer",
            "traceback": tail,
        }
    how = f"was killed by signal {-code}" if code and code < 0 else f"exited with code {code}"
    return {
        "type": "error",
        "status": "failed",
        "reason": f"the arm's process {how} without a result",
        "traceback": tail,
    }
