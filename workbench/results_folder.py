"""The results folder of a run: which files in it workbench wrote, and who is writing it now.

Two promises rest on this module:

* **Never delete what the user owns.** Every file workbench writes into the folder is first
  entered in a manifest kept in the folder (``.workbench-manifest.json``). ``overwrite`` removes
  exactly those files, and refuses, listing them, when the folder holds anything else.
* **Two runs never share a folder unnoticed.** A run holds an exclusive lock on the folder
  (``.workbench-lock``, with ``fcntl.flock``) from the moment it opens it until it ends. A second
  run fails at once, naming the first run's process ID. The kernel drops a flock when its
  holder dies, so a lock file left by a killed run is simply taken over.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

try:  # POSIX; workbench's workers and process groups are POSIX-only too
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

MANIFEST = ".workbench-manifest.json"
LOCK = ".workbench-lock"


class FolderInUse(ValueError):
    """Another live run holds the folder's lock."""


class ResultsFolder:
    """One run's view of its ``out`` folder: the manifest of its files, and the lock."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock_file = None
        self._owned = set(self._read_manifest())

    # --- the lock ---------------------------------------------------------------------------

    def lock(self) -> str | None:
        """Take the folder's lock, or raise FolderInUse naming the holder.

        Returns a note when a lock left by a run that no longer exists was taken over.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = open(self.path / LOCK, "a+")  # noqa: SIM115 - held open for the whole run
        except OSError as error:
            raise ValueError(f"out={str(self.path)!r} cannot be written: {error.strerror or error}") from None
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                holder = _parse_holder(handle.read())
                handle.close()
                raise FolderInUse(
                    f"out={str(self.path)!r} is in use by another workbench run ({holder}); wait for it to "
                    "finish, or choose another out"
                ) from None
        handle.seek(0)
        left = handle.read().strip()  # a run that ended cleanly leaves the file empty
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        handle.flush()
        self._lock_file = handle
        if left:
            return f"took over the lock that an earlier run left in {self.path} ({_parse_holder(left)}, no longer running)"
        return None

    def unlock(self) -> None:
        if self._lock_file is not None:
            # Emptied, not removed: a run that opened the file a moment ago must lock the same
            # file as the next one, and an empty lock file is not mistaken for one left behind.
            self._lock_file.truncate(0)
            self._lock_file.close()  # closing releases the flock
            self._lock_file = None

    # --- the manifest -----------------------------------------------------------------------

    def file(self, relative: str | os.PathLike) -> Path:
        """The path of a file workbench is about to write, entered in the manifest first."""
        name = Path(relative).as_posix()
        if name not in self._owned:
            self._owned.add(name)
            self._write_manifest()
        return self.path / name

    def nest(self, name: str) -> Path:
        """A folder inside this one that a run of its own writes, with its own manifest and lock
        (the tuner's rounds). It is entered here as ``name/``, and its own manifest says which of
        its files workbench wrote: those count as this folder's, and ``clear`` removes them."""
        entry = name.strip("/") + "/"
        if entry not in self._owned:
            self._owned.add(entry)
            self._write_manifest()
        return self.path / entry[:-1]

    def _nested(self) -> list[str]:
        return sorted(entry[:-1] for entry in self._owned if entry.endswith("/"))

    def foreign_files(self, limit: int | None = None) -> list[str]:
        """Files in the folder that workbench did not write (relative paths, sorted), or the
        first ``limit`` found (a user who points ``out`` at a big folder waits for no full scan)."""
        if not self.path.is_dir():
            return []
        foreign = []
        nested = self._nested()
        for inner in nested:  # a nested run's folder answers for its own files
            foreign += [f"{inner}/{name}" for name in ResultsFolder(self.path / inner).foreign_files(limit)]
        if limit is not None and len(foreign) >= limit:
            return sorted(foreign)[:limit]
        for path in self.path.rglob("*"):
            if not (path.is_file() or path.is_symlink()):
                continue
            name = path.relative_to(self.path).as_posix()
            if name in (MANIFEST, LOCK) or name in self._owned or self._is_own_temporary(name):
                continue
            if any(name.startswith(inner + "/") for inner in nested):
                continue
            foreign.append(name)
            if limit is not None and len(foreign) >= limit:
                break
        return sorted(foreign)

    def clear(self) -> None:
        """Remove the files workbench wrote here (``overwrite``); refuse if anything else is here."""
        foreign = self.foreign_files()
        if foreign:
            shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
            raise ValueError(
                f"overwrite: out={str(self.path)!r} holds files that workbench did not write, so it deletes "
                f"nothing there: {shown}. Move them away, or choose another out"
            )
        for inner in self._nested():
            folder = ResultsFolder(self.path / inner)
            folder.clear()
            for leftover in (MANIFEST, LOCK):
                (folder.path / leftover).unlink(missing_ok=True)
            if folder.path.is_dir() and not any(folder.path.iterdir()):
                folder.path.rmdir()
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
        # write_json_atomic's temporary file is "<name><random>.tmp" beside the target; a run
        # killed mid-write leaves one behind.
        return name.endswith(".tmp") and any(name.startswith(own) for own in self._owned | {MANIFEST})

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


def _parse_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"process {holder['pid']} on {holder['host']}, since {time.ctime(holder['since'])}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


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


def write_json_atomic(path: Path, record: Any) -> None:
    """Write to a temporary file and rename it into place: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(json_values(record), file, indent=1, allow_nan=False)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
