"""The results folder of a run: which files in it workbench wrote, and who is writing it now.

Two promises rest on this module:

* **Never delete what the user owns.** Every file workbench writes into the folder is first
  entered in a manifest kept in the folder (``.workbench-manifest.json``). ``overwrite`` removes
  exactly those files, and refuses, listing them, when the folder holds anything else. Two
  kinds of entry stand for more than one file: ``name/`` is a nested run's folder, which
  answers for its own files through its own manifest (the tuner's rounds, a Slurm job's
  block), and ``name/**`` is a folder another program fills for workbench, all of it
  workbench's (submitit's job folder).
* **Two runs never share a folder unnoticed.** A run holds the folder's lock
  (``.workbench-lock``) from the moment it opens it until it ends. The lock is an exclusive
  create, not ``flock``: on a network filesystem shared by a cluster's nodes, ``flock`` may be
  emulated per node or not at all, while creating a name that must not exist yet (a hard link
  of a finished file, the classic NFS-safe form) succeeds for one process only. The file says
  who holds it: host, process ID and that process's start time. A second run fails at once,
  naming the holder. A lock whose holder ran on this host and no longer exists is taken over;
  one held from another host is never guessed dead: the message says which file to remove.
  Runs that find the same dead holder take turns to remove its lock (``flock`` on a side file,
  ``.workbench-lock.takeover``; every contender runs on the dead holder's host, so a per-node
  ``flock`` is enough), and each looks again inside its turn, so none removes a lock that a
  faster contender has just taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = ".workbench-manifest.json"
LOCK = ".workbench-lock"
TAKEOVER = LOCK + ".takeover"  # held (flock) while a dead holder's lock is removed


class FolderInUse(ValueError):
    """Another live run holds the folder's lock."""


class ResultsFolder:
    """One run's view of its ``out`` folder: the manifest of its files, and the lock."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()  # "--out=~/x": the shell leaves a ~ after = alone
        self._holder: dict | None = None  # what this run wrote into the lock file while it holds it
        self._made: list[Path] = []  # the folders lock() created, deepest first
        self._owned = set(self._read_manifest())

    # --- the lock ---------------------------------------------------------------------------

    def lock(self) -> str | None:
        """Take the folder's lock, or raise FolderInUse naming the holder.

        Returns a note when a lock left by a run that no longer exists was taken over.
        """
        missing = self._not_made_yet()
        self._make()
        self._made = missing
        note = None
        for _ in range(5):  # another run may take or drop the lock between two of our steps
            holder = _holder_record()
            try:
                taken = _create_exclusively(self.path / LOCK, json.dumps(holder))
            except PermissionError as error:  # an existing folder this user may not write
                raise ValueError(f"out={str(self.path)!r} cannot be written: {error.strerror}") from None
            if taken:
                self._holder = holder
                return note
            left = self._read_lock()
            if left is None:  # gone meanwhile: try again
                continue
            self._refuse_a_live_holder(left)
            if self._remove_stale_lock() and left:  # {}: an empty file, left by an older workbench
                note = (
                    f"took over the lock that an earlier run left in {self.path} ({_describe_holder(left)}, "
                    "no longer running)"
                )
        raise FolderInUse(f"out={str(self.path)!r}: its lock changed hands repeatedly; try again")

    def refuse_if_it_cannot_be_made(self) -> None:
        """What ``lock`` would refuse for a folder that does not exist yet (a file among its
        parents, a place this user may not write): it is made, then removed again, only the
        folders made here and only while they are empty."""
        missing = self._not_made_yet()
        try:
            self._make()
        finally:
            for folder in missing:  # the deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()

    def _not_made_yet(self) -> list[Path]:
        """This folder and those of its parents that do not exist yet, the deepest first."""
        return [folder for folder in (self.path, *self.path.parents) if not folder.exists()]

    def _make(self) -> None:
        """The folder and its parents made (another run may make them meanwhile), or one line why not."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"out={str(self.path)!r} cannot be written: {error.strerror or error}") from None

    def refuse_if_in_use(self) -> None:
        """FolderInUse where another run holds the lock now: a check that takes no lock (the
        panel's pre-flight), which would otherwise read that run's half-written files."""
        left = self._read_lock()
        if left:
            self._refuse_a_live_holder(left)

    def _refuse_a_live_holder(self, left: dict) -> None:
        if left and left.get("host") != socket.gethostname():
            raise FolderInUse(
                f"out={str(self.path)!r} is locked by a workbench run on another host "
                f"({_describe_holder(left)}), which this machine cannot check. If that run has ended, remove "
                f"{self.path / LOCK}; otherwise wait for it, or choose another results folder"
            )
        if left and _is_alive(left):
            raise FolderInUse(
                f"out={str(self.path)!r} is in use by another workbench run ({_describe_holder(left)}); wait "
                "for it to finish, or choose another results folder"
            )

    def unlock(self) -> None:
        """Drop the lock, if this run still holds it (never another run's). The folders lock()
        created go too where they are left empty: a run refused before it wrote anything (a
        search with nothing that can run here) leaves no empty folder behind."""
        if self._holder is not None:
            if self._read_lock() == self._holder:
                (self.path / LOCK).unlink(missing_ok=True)
            self._holder = None
            for folder in self._made:
                try:
                    folder.rmdir()  # only an empty folder: anything in it, ours or not, keeps it
                except OSError:
                    break
            self._made = []

    def _read_lock(self) -> dict | None:
        """The lock's holder; {} for an empty or unreadable lock file; None when there is no lock."""
        try:
            text = (self.path / LOCK).read_text()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
        except ValueError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def _remove_stale_lock(self) -> bool:
        """Remove the lock if its holder is still gone, in a turn of our own.

        Without turns, two runs that both found the lock stale could both remove "it": the
        slower one would remove the lock that the faster one had taken in between, and both
        would run. Inside the turn the lock is read again, and it cannot change before we
        remove it: only a run in its turn removes a lock, and none is created while one exists.
        """
        with _turn(self.path / TAKEOVER):
            left = self._read_lock()
            if left is None:
                return False
            if left and (left.get("host") != socket.gethostname() or _is_alive(left)):
                return False  # another run took it before our turn
            (self.path / LOCK).unlink()
            return True

    # --- the manifest -----------------------------------------------------------------------

    def file(self, relative: str | os.PathLike) -> Path:
        """The path of a file workbench is about to write, entered in the manifest first."""
        name = Path(relative).as_posix()
        self._own(name)
        return self.path / name

    def nest(self, name: str) -> Path:
        """A folder inside this one that a run of its own writes, with its own manifest and lock
        (the tuner's rounds). It is entered here as ``name/``, and its own manifest says which of
        its files workbench wrote: those count as this folder's, and ``clear`` removes them."""
        entry = name.strip("/") + "/"
        self._own(entry)
        return self.path / entry[:-1]

    def tree(self, name: str) -> Path:
        """A folder inside this one whose every file is workbench's, whatever its name (the files
        another program writes for workbench: submitit's job folder). Entered as ``name/**``."""
        self._own(name.strip("/") + "/**")
        return self.path / name.strip("/")

    def _own(self, entry: str) -> None:
        """Enter a file (or a nested folder, or a tree) in the manifest, before it is written.

        What another workbench process entered meanwhile (``workbench report`` while the run goes
        on) is kept: the manifest on disk is read again and joined, not overwritten."""
        if entry not in self._owned:
            try:
                self._owned.update(self._read_manifest())
            except ValueError:  # damaged meanwhile: this run's own entries are all it can vouch for
                pass
            self._owned.add(entry)
            self._write_manifest()

    def _trees(self) -> list[str]:
        return sorted(entry[:-3] for entry in self._owned if entry.endswith("/**"))

    def _nested(self) -> list[str]:
        return sorted(entry[:-1] for entry in self._owned if entry.endswith("/"))

    def own_files(self) -> list[str]:
        """What workbench wrote here that is still here (manifest entries; ``name/`` for a nested
        run's folder, ``name/**`` for a tree)."""
        return sorted(
            entry for entry in self._owned if (self.path / entry.rstrip("/").removesuffix("/**")).exists()
        )

    def refuse_inside_another_run(self, label: str = "out=", made_for_it: bool = False) -> None:
        """Raise when this folder lies inside another run's folder: that run's resume would read
        this one's files as its own, and its ``overwrite`` would refuse them. Only the run that
        made room for a folder there (``nest``, ``tree``: the tuner's rounds, a Slurm job's block)
        enters it, saying so with ``made_for_it``; any other run is refused there too, since it
        would take the place of that run's own results."""
        here = self.path.resolve()
        for parent in here.parents:
            if not ((parent / MANIFEST).is_file() or (parent / LOCK).exists()):
                continue
            inside = here.relative_to(parent).as_posix()
            made_room = [e.removesuffix("/**").rstrip("/") for e in ResultsFolder(parent)._owned if e.endswith("/")
                         or e.endswith("/**")]  # fmt: skip
            if not any(inside == room or inside.startswith(room + "/") for room in made_room):
                raise ValueError(
                    f"{label}{str(self.path)!r} is inside the workbench results folder {str(parent)!r}; "
                    "choose a folder outside it"
                )
            if made_for_it:
                return
            raise ValueError(
                f"{label}{str(self.path)!r} is where the workbench run in {str(parent)!r} keeps its own "
                "runs (a search's rounds, a Slurm job's block); choose a folder outside it (to resume "
                "that run, run its own command again)"
            )

    def refuse_other_results(self, marker: str, what: str) -> None:
        """Raise when the folder holds workbench results but not ``marker``, the file that ``what``
        ("an ablation", "a search") keeps: a run of another kind must not mix into them."""
        if (self.path / marker).exists():
            return
        own = self.own_files()
        if own:
            raise ValueError(
                f"out={str(self.path)!r} holds other workbench results ({', '.join(own[:4])}"
                f"{', ...' if len(own) > 4 else ''}), not {what}'s; choose another results folder, or pass "
                "overwrite=True to discard them"
            )

    def foreign_files(self, limit: int | None = None) -> list[str]:
        """Files in the folder that workbench did not write (relative paths, sorted), or the
        first ``limit`` found (a user who points ``out`` at a big folder waits for no full scan).
        A nested run's folder answers for its own files (``_wrote_by``)."""
        if not self.path.is_dir():
            return []
        foreign, wrote = [], self._wrote_by()
        for path in self.path.rglob("*"):
            if not (path.is_file() or path.is_symlink()):
                continue
            name = path.relative_to(self.path).as_posix()
            if wrote(name):
                continue
            foreign.append(name)
            if limit is not None and len(foreign) >= limit:
                break
        return sorted(foreign)

    def refuse_foreign_files(self, resuming: bool, writes: tuple[str, ...]) -> None:
        """Raise, naming up to five, when files workbench did not write are here. A run resuming
        here keeps the user's own files beside it, but not where it writes (``writes``: its file
        names, and its folders' prefixes, which end in "/" or "-")."""
        foreign = self.foreign_files(limit=None if resuming else 5)
        if resuming:
            prefixes = tuple(name for name in writes if name.endswith(("/", "-")))
            foreign = [name for name in foreign if name in writes or name.startswith(prefixes)]
        if foreign:
            raise ValueError(
                f"out={str(self.path)!r} holds {self._describe_not_ours(foreign, 5)}; choose a new or empty folder"
            )

    def _describe_not_ours(self, foreign: list[str], shown: int) -> str:
        """What the files this folder's runs did not write are: the folders of other workbench runs
        (each with a manifest of its own: another run's results, not the user's) and the user's files."""
        runs, users = set(), []
        judges: dict[Path, Callable[[str], bool] | None] = {}  # each run's manifest, read once
        for name in foreign:
            outermost_first = [p for p in reversed(Path(name).parents) if p.name]  # "r1", "r1/units"...
            run = next(
                (p for p in outermost_first if self._run_wrote(p, Path(name).relative_to(p), judges)), None
            )
            if run is None:
                users.append(name)
            else:
                runs.add(f"{run.as_posix()}/")
        parts = []
        if runs:
            named = sorted(runs, key=lambda run: (run.count("/"), run))  # outermost first
            parts.append(
                f"the results of {'another workbench run' if len(runs) == 1 else 'other workbench runs'} "
                f"({', '.join(named[:shown])}{', ...' if len(named) > shown else ''})"
            )
        if users:
            parts.append(
                f"files that workbench did not write there ({', '.join(users[:shown])}{', ...' if len(users) > shown else ''})"
            )
        return " and ".join(parts)

    def _run_wrote(self, folder: Path, name: Path, judges: dict) -> bool:
        """Whether the workbench run in ``folder`` (relative to this one) wrote its file ``name``: a
        user's file inside a run's folder is still the user's. ``judges`` keeps each folder's answer
        to "is this a run, and which files are its", for the next file."""
        if folder not in judges:
            judges[folder] = None
            if (self.path / folder / MANIFEST).is_file():
                with contextlib.suppress(ValueError):  # a damaged manifest vouches for nothing
                    judges[folder] = ResultsFolder(self.path / folder)._wrote_by()
        judge = judges[folder]
        return judge is not None and judge(name.as_posix())

    def wrote(self, relative: str) -> bool:
        """Whether workbench wrote this folder's file ``relative`` (a path inside it), by its manifest."""
        return self._wrote_by()(relative)

    def _wrote_by(self) -> Callable[[str], bool]:
        """Whether workbench wrote a file of this folder (a path relative to it), by its manifest,
        its trees' and its nested runs' (what ``foreign_files`` leaves out), as a function for many
        files: each nested run's manifest is read once, not once per file."""
        trees = self._trees()
        nested = {inner: ResultsFolder(self.path / inner)._wrote_by() for inner in self._nested()}

        def wrote(name: str) -> bool:
            if name in (MANIFEST, LOCK, TAKEOVER) or name in self._owned or self._is_own_temporary(name):
                return True
            if any(name.startswith(tree + "/") for tree in trees):
                return True
            inner = next((inner for inner in nested if name.startswith(inner + "/")), None)
            return inner is not None and nested[inner](name[len(inner) + 1 :])

        return wrote

    def refuse_to_clear_foreign(self) -> None:
        """Raise, naming them, when files workbench did not write are here: ``clear`` would refuse."""
        foreign = self.foreign_files()
        if foreign:
            raise ValueError(
                f"overwrite: out={str(self.path)!r} holds {self._describe_not_ours(foreign, 10)}; workbench "
                "deletes only what this run wrote, so nothing there. Move them away, or choose another results folder"
            )

    def clear(self) -> None:
        """Remove the files workbench wrote here (``overwrite``); refuse if anything else is here."""
        self.refuse_to_clear_foreign()
        for inner in self._nested():
            folder = ResultsFolder(self.path / inner)
            folder.clear()
            for leftover in (MANIFEST, LOCK, TAKEOVER):
                (folder.path / leftover).unlink(missing_ok=True)
            if folder.path.is_dir() and not any(folder.path.iterdir()):
                folder.path.rmdir()
        for tree in self._trees():
            shutil.rmtree(self.path / tree, ignore_errors=True)
        directories = set()
        for path in self.path.rglob("*"):
            name = path.relative_to(self.path).as_posix()
            if path.is_file() and (name in self._owned or self._is_own_temporary(name)):
                path.unlink()
                directories.update(parent for parent in path.parents if self.path in parent.parents)
        for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()  # only folders that held nothing but workbench's files
        self._owned = set()
        self._write_manifest()

    def _is_own_temporary(self, name: str) -> bool:
        # write_text_atomic's temporary file is "<name><random>.tmp" beside the target; a run
        # killed mid-write leaves one behind.
        return name.endswith(".tmp") and any(name.startswith(own) for own in self._owned | {MANIFEST, LOCK})

    def _read_manifest(self) -> list[str]:
        try:
            entries = json.loads((self.path / MANIFEST).read_text())["files"]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(
                f"{self.path / MANIFEST} is not a workbench manifest ({error}); remove it"
            ) from None
        return [str(entry) for entry in entries]

    def _write_manifest(self) -> None:
        write_json_atomic(self.path / MANIFEST, {"files": sorted(self._owned)})


def _holder_record() -> dict:
    """Who holds a lock: enough to tell, later and from this host, whether that process still lives."""
    import psutil

    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
              "started": psutil.Process().create_time()}  # fmt: skip
    if os.environ.get("SLURM_JOB_ID"):
        record["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return record


def _create_exclusively(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``, unless it exists. The text is written to a private file
    first and hard-linked into place, so the lock never exists half-written, and the link is
    atomic on local and network filesystems alike."""
    handle, private = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        try:
            os.link(private, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(private)


@contextlib.contextmanager
def _turn(path: Path):
    """Hold an exclusive ``flock`` on ``path`` (made if missing), and remove the file as the turn ends.

    A run that opened the file before the holder removed it gets a lock on a file that no longer
    has that name, so after each ``flock`` the name is checked to still be this file; if not,
    it opens the name again. One turn at a time, and no file left behind."""
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            if os.stat(path).st_ino == os.fstat(handle).st_ino:
                break
        except FileNotFoundError:
            pass
        except OSError as error:  # a filesystem without flock: no run can hold a turn here
            os.close(handle)
            path.unlink(missing_ok=True)
            raise FolderInUse(
                f"out={str(path.parent)!r} holds a lock left by a run that no longer exists, and this "
                f"filesystem cannot lock {path.name} to take it over safely ({error.strerror or error}); "
                f"remove {path.parent / LOCK} if no run is using the folder"
            ) from None
        os.close(handle)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock is released: a waiter then sees the name gone
        os.close(handle)


def _is_alive(holder: dict) -> bool:
    """Whether the lock's holder, a process of this host, still runs (a reused process ID does not count)."""
    import psutil

    try:
        process = psutil.Process(int(holder["pid"]))
        if process.status() == psutil.STATUS_ZOMBIE:  # ended, not yet reaped by its parent
            return False
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False
    started = holder.get("started")
    # A process that started after the lock was taken is another program with a reused ID.
    return started is None or process.create_time() <= float(started) + 1.0


def _describe_holder(holder: dict) -> str:
    try:
        text = f"process {holder['pid']} on {holder['host']}, since {time.ctime(holder['since'])}"
    except (KeyError, TypeError, ValueError):
        return "a process that left no details"
    if holder.get("slurm_job_id"):
        text += f", Slurm job {holder['slurm_job_id']}"
    return text


def refuse_a_file_not_ours(target: Path, written_by_us, name: str) -> None:
    """Raise when ``target`` exists and ``written_by_us(target)`` says workbench did not write it:
    the one check before any single file (a report, advice's JSON or plot) is replaced."""
    if target.exists() and not written_by_us(target):
        raise ValueError(
            f"{name} exists and workbench did not write it; choose another path "
            "(workbench replaces only files it wrote)"
        )


def json_values(value: Any) -> Any:
    """JSON has no NaN/Infinity: an unavailable figure is null (None), in files and in memory."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_values(item) for item in value]
    if isinstance(value, np.generic):
        return json_values(value.item())
    return value


# Read once, at import (setting it is the only way to read it): mkstemp makes its files
# readable by their owner only, and a rename keeps that; the results get the mode any other file
# written here gets (table.csv, plot.png), so that colleagues on a shared file system can read them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_json_atomic(path: Path, record: Any) -> None:
    """``record`` as JSON (NaN as null), written whole or not at all (``write_text_atomic``)."""
    write_text_atomic(path, json.dumps(json_values(record), indent=1, allow_nan=False))


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary file and rename it into place: a reader never sees half a file, and
    a failure (a full disk, Ctrl-C) leaves the earlier file as it was and no temporary behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        os.fchmod(handle, 0o666 & ~_UMASK)
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
