"""A warm template for worker processes: torch is imported once per run, not once per block.

Starting ``python -m workbench.worker`` costs about 3.5 s on the CI machine before the first
step: the interpreter, torch (2 s) and torch's compiler stack (1.5 s), which every block
imports. A run of several blocks, plus the arms that need processes of their own, pays that
each time. The template is one process, started at the beginning of a run, that imports all of
it once and then forks a fresh worker for each process the run needs. It outlives the run only
to serve the next one, for a while (below).

Isolation is kept: every worker is still a new process with its own memory, random state and
torch state, which ends with its block; what it shares with the others is the imported code,
read-only, as after any fork, and one thing a running interpreter cannot change, the seed of
its string hashes (a spawned worker draws its own; set PYTHONHASHSEED, or start="spawn", where
the iteration order of a set of strings should differ between blocks). Each worker takes the
CPUs, niceness and resource limits of the run's thread that asked for it, as a spawned one
would (``placement``). The template itself never runs a tensor operation, so no thread
pool and no CUDA context exists when it forks (it checks, and refuses to serve otherwise).

The template outlives its run for a while: the next run in the same Python process (the next
cell of a notebook, the panel's next Run, the tuner's next round, the next test) forks from it
instead of importing torch again. It closes ``WORKBENCH_KEEP_WARM_S`` seconds (300 unless set;
0 closes it with each run) after the last run using it ended, when the Python process exits,
or at ``close_kept_template()``. It is started afresh when anything it imported could differ:
another interpreter, ``sys.path``, working directory or environment (bar ``PYTEST_CURRENT_TEST``),
or an edited workbench source file.

Its log lives in a folder of its own in the temporary folder, removed when it closes. A run
killed outright (SIGKILL: no exit handlers) cannot remove it, so the template, which ends with
its parent, removes it then (``serve``). What a template killed outright itself leaves, the
first template a later Python process starts removes once it is an hour old (a template's log
may be read for a while), and only that (``_sweep_abandoned_log_dirs``).

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

import atexit
import contextlib
import fcntl
import importlib.util
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

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

    def __init__(self, log_path: Path, wait: bool = True):
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            # The lock travels with the log's open file into the template (its stdout), so it is
            # held exactly as long as the template lives, however its parent ended: a later
            # run's sweep (_sweep_abandoned_log_dirs) can tell an abandoned log folder by it.
            fcntl.flock(log.fileno(), fcntl.LOCK_EX)
            # A folder workbench made for the log is the template's to remove if its parent dies first.
            own_folder = [str(log_path.parent)] if log_path.parent.name.startswith(LOG_DIR_PREFIX) else []
            self.process = subprocess.Popen(
                [sys.executable, "-m", "workbench.template", str(theirs.fileno()), *own_folder],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=[theirs.fileno()],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                # Its own session, as spawned workers have: Jupyter ends a kernel it shuts down
                # "now" (nbval, a dead kernel) with SIGKILL to the kernel's whole process group,
                # which would kill the template too before it could remove its log folder. Out of
                # that group it still ends with the run's process (die_with_parent: SIGTERM).
                start_new_session=True,
            )
        theirs.close()
        self._reader = self._control.makefile("rb")
        self._lock = threading.Lock()  # one spawn at a time: replies come back in order
        self._pid_reply: list[int] = []
        self._children: dict[int, ForkedWorker] = {}
        self._early_exits: dict[int, int] = {}
        self.log_path = log_path
        self.temporary_dir: str | None = None  # a folder workbench made for the log, removed at the end
        self._replies = threading.Condition()
        self._ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the template has imported everything and can fork (``wait=False`` left it to
        the caller); raises, closing it, when it cannot start."""
        if self._ready:
            return
        ready = self._read_line(READY_TIMEOUT_S)
        if ready.get("ready") is not True:
            self.close()
            raise RuntimeError(ready.get("error") or f"the template did not start (see {self.log_path})")
        self._ready = True
        threading.Thread(target=self._follow, name="workbench-template", daemon=True).start()

    def discard(self) -> None:
        """End a template that no run will use, without waiting for it to finish its imports."""
        self.process.kill()
        self.process.wait()
        self._control.close()

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
            request = json.dumps({"env": env, "cwd": os.getcwd(), "placement": placement()}).encode() + b"\n"
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


def _no_fork_reason() -> str | None:
    if sys.platform.startswith("linux"):
        return None
    return (
        f"plain spawn: the warm template forks, which workbench does only on Linux (this is {sys.platform})"
    )


def start_template(log_path: Path) -> tuple[WarmTemplate | None, str]:
    """A running template, or None and why the run's workers start as plain processes instead."""
    if (reason := _no_fork_reason()) is not None:
        return None, reason
    started = time.perf_counter()
    try:
        template = WarmTemplate(log_path)
    except Exception as error:
        return None, f"plain spawn: the warm template did not start ({error})"
    return template, _forked_after(time.perf_counter() - started)


def _forked_after(ready_s: float) -> str:
    """How the run's workers started, for the results."""
    return f"forked from a warm template (ready in {ready_s:.1f} s)"


# --- one template kept warm between the runs of a Python process ------------------------------

KEEP_WARM_S = 300.0  # the default of WORKBENCH_KEEP_WARM_S
# pytest rewrites it before every test; workers get the current environment with each request
# anyway, so it cannot change what the template imported.
NOT_FINGERPRINTED = frozenset({"PYTEST_CURRENT_TEST"})


def keep_warm_s() -> float:
    """How long the kept template waits for the next run (WORKBENCH_KEEP_WARM_S, in seconds)."""
    text = os.environ.get("WORKBENCH_KEEP_WARM_S", "").strip()
    if not text:
        return KEEP_WARM_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise ValueError(
            "WORKBENCH_KEEP_WARM_S must be a number of seconds >= 0 (how long the warm template waits "
            f"for the next run; 0 closes it after each run); got {text!r}"
        )
    return seconds


@dataclass
class _Kept:
    template: WarmTemplate
    fingerprint: tuple
    log_dir: str  # made by workbench for this template's log, removed with it
    users: int = 0  # runs using it now (the tuner holds one use for its whole search)
    timer: threading.Timer | None = None


_kept: _Kept | None = None
_kept_lock = threading.Lock()
# The template gets SIGTERM when the *thread* that started it ends (PR_SET_PDEATHSIG), so a
# template kept between runs is started by this long-lived thread, not by a run's own thread
# (the panel runs each ablation in a thread that ends with it).
_starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-template-starter")


def _fingerprint() -> tuple:
    """What the template's imports depend on; any change means a fresh template."""
    package = Path(__file__).resolve().parent
    folders = [package]
    datasets = importlib.util.find_spec("workbench.datasets")  # installed from datasets/, beside it
    if datasets is not None and datasets.submodule_search_locations:
        folders += [Path(folder) for folder in datasets.submodule_search_locations]
    sources = max((f.stat().st_mtime_ns for folder in folders for f in folder.rglob("*.py")), default=0)
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k not in NOT_FINGERPRINTED))
    return (sys.executable, tuple(sys.path), os.getcwd(), environment, sources)


LOG_DIR_PREFIX = "workbench-template-"
LOG_NAME = "template.log"
ABANDONED_AFTER_S = 3600.0  # a template that failed to start leaves its log this long, for its reader
_swept = False


def _new_log_dir() -> str:
    """A fresh folder for a template's log (after sweeping the ones killed runs left behind)."""
    global _swept
    if not _swept:
        _swept = True
        _sweep_abandoned_log_dirs(Path(tempfile.gettempdir()))
    return tempfile.mkdtemp(prefix=LOG_DIR_PREFIX)


def _sweep_abandoned_log_dirs(folder: Path) -> list[Path]:
    """Remove the template log folders that runs killed outright (SIGKILL: no atexit) left behind.

    Only folders this user owns, named as workbench names them, holding nothing but workbench's
    own log (or nothing), untouched for ABANDONED_AFTER_S, and whose template is gone: the log's
    lock (taken in WarmTemplate) is free. Anything else is left alone. Returns what it removed.
    """
    removed = []
    now = time.time()
    for log_dir in folder.glob(LOG_DIR_PREFIX + "*"):
        try:
            if log_dir.is_symlink() or not log_dir.is_dir() or log_dir.stat().st_uid != os.getuid():
                continue
            log = log_dir / LOG_NAME
            if not _holds_only_our_log(log_dir):  # something workbench did not write: not ours to remove
                continue
            touched = max(path.stat().st_mtime for path in [log_dir, log] if path.exists())
            if now - touched < ABANDONED_AFTER_S or (log.exists() and not _lock_is_free(log)):
                continue
            shutil.rmtree(log_dir)
            removed.append(log_dir)
        except OSError:  # another process's sweep, or a folder we may not read: not ours to fight over
            continue
    return removed


def _holds_only_our_log(log_dir: str | Path) -> bool:
    """Whether a template's log folder holds nothing but workbench's own log (or nothing)."""
    return {entry.name for entry in os.scandir(log_dir)} <= {LOG_NAME}


def _lock_is_free(log: Path) -> bool:
    """Whether no template holds ``log``'s lock (it ended, however its parent ended)."""
    with open(log, "rb") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


@dataclass
class _Starting:
    """A template that ``prewarm`` started in the background, not yet taken by a run."""

    fingerprint: tuple
    log_dir: str
    started: Future  # the WarmTemplate, still importing (wait=False)
    began: float


_starting: _Starting | None = None


def prewarm() -> None:
    """Start the template now, in the background, for a run this process is about to begin.

    The command line calls this before it imports torch itself, so that the template's imports
    (about 2 s here) overlap the parent's own instead of following them. The run's
    ``acquire_template`` takes it if nothing it depends on changed in between (else ends it
    and starts another); if no run comes (bad input), it is killed as the process exits,
    without waiting for its imports. Where no template would be kept or forked from, this
    does nothing.
    """
    global _starting
    if _no_fork_reason() is not None:
        return
    try:
        keep_warm_s()
    except ValueError:  # the run itself refuses it, with its message
        return
    with _kept_lock:
        if _kept is not None or _starting is not None:
            return
        log_dir = _new_log_dir()
        # The starter thread starts the process (it dies with that thread), without waiting.
        started = _starter.submit(WarmTemplate, Path(log_dir) / LOG_NAME, False)
        _starting = _Starting(_fingerprint(), log_dir, started, time.perf_counter())


def _adopt_started_locked(use: bool) -> str | None:
    """With ``use``, the prewarmed template becomes the kept one once ready, if it still fits
    (then: how it started, for the results); otherwise it is ended at once, and None."""
    global _kept, _starting
    if _starting is None:
        return None
    starting, _starting = _starting, None
    try:
        template = starting.started.result()
        if use and _kept is None and starting.fingerprint == _fingerprint():
            template.wait_ready()
            _kept = _Kept(template, starting.fingerprint, starting.log_dir)
            return _forked_after(time.perf_counter() - starting.began)
        template.discard()
    except Exception:  # it could not start: the run starts its own, which says why if it fails too
        pass
    except BaseException:  # Ctrl-C while it finished starting: it and its folder end once it exists
        starting.started.add_done_callback(lambda future: _discard_started(future, starting.log_dir))
        raise
    shutil.rmtree(starting.log_dir, ignore_errors=True)
    return None


def _discard_started(started: Future, log_dir: str) -> None:
    """A prewarmed template whose run was interrupted while it finished starting: nobody will use it."""
    try:
        started.result().discard()
    except Exception:  # it never started: nothing to end
        pass
    shutil.rmtree(log_dir, ignore_errors=True)


def acquire_template() -> tuple[WarmTemplate | None, str]:
    """A template for a run's processes, and how its workers start (for the results). It is the
    kept one when that still fits (or the one ``prewarm`` started), else a new one, kept if
    nothing else is using the old one. None (plain spawns) where a template cannot start. Give
    it back with ``release_template``."""
    global _kept
    keep_warm_s()  # a bad WORKBENCH_KEEP_WARM_S is refused before the run, not after it
    if (reason := _no_fork_reason()) is not None:
        return None, reason
    with _kept_lock:
        prewarmed = _adopt_started_locked(use=True)
        fingerprint = _fingerprint()
        if _kept is not None and _kept.users == 0:
            if _kept.fingerprint != fingerprint or not _kept.template.alive():
                _close_kept_locked()
        if _kept is not None and _kept.fingerprint == fingerprint and _kept.template.alive():
            if _kept.timer is not None:
                _kept.timer.cancel()
                _kept.timer = None
            _kept.users += 1
            if prewarmed is not None:  # "forked from a warm template (ready in 2.1 s)"
                return _kept.template, f"{prewarmed}, started before the run was set up"
            return (
                _kept.template,
                "forked from a warm template kept from an earlier run in this Python process",
            )
        log_dir = _new_log_dir()
        starting = _starter.submit(start_template, Path(log_dir) / LOG_NAME)
        try:
            template, how = starting.result()
        except BaseException:  # interrupted while it starts (a notebook's interrupt): end it once started
            starting.add_done_callback(lambda future: _end_unclaimed(future, log_dir))
            raise
        # A template that did not start leaves its log where ``how`` points, for whoever reads why;
        # where ``how`` says why itself, nothing is left to read there.
        if template is None and log_dir not in how:
            shutil.rmtree(log_dir, ignore_errors=True)
        if template is not None and _kept is None:  # kept for the runs after this one
            _kept = _Kept(template, fingerprint, log_dir, users=1)
        elif template is not None:  # the kept one is busy with another run (another environment)
            template.temporary_dir = log_dir  # so this one ends with its run, log folder and all
        return template, how


def _end_unclaimed(started: Future, log_dir: str) -> None:
    """A template whose run was interrupted before it was ready: nobody will use or close it."""
    template, _ = started.result()
    if template is not None:
        template.close()
    shutil.rmtree(log_dir, ignore_errors=True)


def release_template(template: WarmTemplate | None) -> None:
    """A run is done with ``template``: the kept one waits for the next run, another one closes."""
    global _kept
    if template is None:
        return
    with _kept_lock:
        if _kept is None or template is not _kept.template:
            template.close()
            if template.temporary_dir:
                shutil.rmtree(template.temporary_dir, ignore_errors=True)
            return
        _kept.users -= 1
        if _kept.users > 0:
            return
        try:
            wait_s = keep_warm_s()
        except ValueError:  # set to nonsense during the run (it was checked before): keep nothing
            wait_s = 0.0
        if wait_s == 0 or not _kept.template.alive():
            _close_kept_locked()
            return
        kept = _kept
        kept.timer = threading.Timer(wait_s, _close_if_idle, args=(kept,))
        kept.timer.daemon = True
        kept.timer.start()


def _close_if_idle(kept: _Kept) -> None:
    with _kept_lock:
        if _kept is kept and kept.users == 0:
            _close_kept_locked()


def _close_kept_locked() -> None:
    global _kept
    if _kept is None:
        return
    if _kept.timer is not None:
        _kept.timer.cancel()
    _kept.template.close()
    shutil.rmtree(_kept.log_dir, ignore_errors=True)
    _kept = None


def close_kept_template() -> None:
    """Close the template kept between runs now, if it is idle (it closes by itself anyway)."""
    with _kept_lock:
        _adopt_started_locked(use=False)
        if _kept is not None and _kept.users == 0:
            _close_kept_locked()


def kept_template() -> WarmTemplate | None:
    """The template kept between runs, if one is running (for tests and diagnostics)."""
    with _kept_lock:
        _adopt_started_locked(use=True)
        return _kept.template if _kept is not None and _kept.template.alive() else None


atexit.register(close_kept_template)


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
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        take_placement(request["placement"])
        from workbench import worker

        code = worker.main()
    except BaseException:  # noqa: BLE001 - whatever happens, this child must not return into the template's loop
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# What a fork from the template would not carry over from the run's own thread, as a spawn does:
# the CPUs it may use (taskset, os.sched_setaffinity), its niceness (Linux keeps both per thread),
# and its resource limits (ulimit). A worker forked without them ran on every core at priority 0
# while its run was pinned to one core and niced.
INHERITED_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_RSS", "RLIMIT_STACK", "RLIMIT_NOFILE", "RLIMIT_NPROC",
                    "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE", "RLIMIT_MEMLOCK")  # fmt: skip


def placement() -> dict:
    """The calling thread's CPUs, niceness and resource limits, for a worker forked on its behalf."""
    import resource

    return {
        "cpus": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "limits": {
            name: resource.getrlimit(getattr(resource, name))
            for name in INHERITED_LIMITS
            if hasattr(resource, name)
        },
    }


def take_placement(wanted: dict) -> None:
    """In a forked worker: the run's CPUs, niceness and limits. What cannot be taken (a lower
    niceness or a higher hard limit than the template's, without the privilege) is said in the log."""
    import resource

    def attempt(what: str, change: Callable[[], object]) -> None:
        try:
            change()
        except (OSError, ValueError) as error:
            print(f"workbench: the forked worker could not take the run's {what}: {error}", file=sys.stderr)

    own = os.sched_getaffinity(0)
    attempt("CPUs", lambda: os.sched_setaffinity(0, wanted["cpus"]))
    cpus = os.sched_getaffinity(0)
    if cpus != own and "OMP_NUM_THREADS" not in os.environ:
        # torch counted its default threads at its import here, on the template's CPUs; on fewer,
        # a spawned worker starts no more threads than it has CPUs. (Unpinned, torch's own default
        # stands, as it would in a spawned worker.)
        import torch

        torch.set_num_threads(max(1, min(torch.get_num_threads(), len(cpus))))
    if os.getpriority(os.PRIO_PROCESS, 0) != wanted["nice"]:
        attempt("niceness", lambda: os.setpriority(os.PRIO_PROCESS, 0, wanted["nice"]))
    for name, (soft, hard) in wanted["limits"].items():
        if hasattr(resource, name) and resource.getrlimit(getattr(resource, name)) != (soft, hard):
            attempt(
                name,
                lambda name=name, soft=soft, hard=hard: resource.setrlimit(
                    getattr(resource, name), (soft, hard)
                ),
            )


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

    # is_initialized alone: is_available() counts the devices, which marks this process so that
    # no forked child can use CUDA ("Cannot re-initialize CUDA in forked subprocess", seen on an
    # H200 where every worker failed so).
    if torch.cuda.is_initialized():
        return "CUDA was initialized while importing; a forked child could not use it"
    return None


def serve(fd: int, log_dir: str | None = None) -> int:
    """The template's loop: import once, then fork a worker per request until the socket closes.

    ``log_dir``: the folder workbench made for its log. When the run's process ends without
    closing it (killed outright, or a notebook kernel that was killed), the template gets SIGTERM
    (``die_with_parent``) or sees its socket close, and removes that folder itself: the parent's
    exit handlers never ran to do it.
    """
    control = socket.socket(fileno=fd)
    # Ctrl-C is the run's process's to handle, which then closes the template. The template has
    # its own session, out of the terminal's reach, and one sent to it anyway must not stop it
    # half-way through forking.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _end_with_parent(log_dir))
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
                _end_with_parent(log_dir)
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


def _end_with_parent(log_dir: str | None) -> NoReturn:
    """End the template, its log folder with it: nobody is left to read the log or remove it.
    Only a folder that holds nothing but workbench's log, as the sweep's rule is."""
    if log_dir is not None:
        with contextlib.suppress(OSError):
            if _holds_only_our_log(log_dir):
                shutil.rmtree(log_dir, ignore_errors=True)
    os._exit(0)  # skip the interpreter's teardown of torch: nothing here needs it


if __name__ == "__main__":
    raise SystemExit(serve(int(sys.argv[1]), *sys.argv[2:3]))
