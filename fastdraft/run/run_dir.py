"""A run directory has one owner: whatever writes into it (a run, its resume, `plot` or `export`
into it) holds an exclusive OS file lock (flock) on LOCK_FILE inside it for as long as it
writes. The lock file names its holder (pid, host, command, since when), so a second writer is
one line naming the first. The OS drops the lock when its holder dies, however it dies; a lock
file that still names a holder then is stale, and the next writer takes it over with a line
saying so. The directory must be new, empty or fastdraft's own run directory
(utils/outputs.py), unless --overwrite; one the claim made is removed again when nothing but
the claim's own files landed in it (a refused start leaves nothing behind)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from fastdraft.errors import FastdraftError, Place, writable_dir
from fastdraft.utils.outputs import MARKER, check_output_dir, mark

LOCK_FILE = ".fastdraft.lock"


class RunDirLock:
    """The held lock of one run directory (a context manager: released on exit)."""

    def __init__(self, path: Path, fd: int, created: bool) -> None:
        self.path, self._fd, self._created = path, fd, created

    @classmethod
    def claim(cls, path: Path, setting: str = "--run-dir", overwrite: bool = False,
              create: bool = True) -> RunDirLock:
        """Takes `path`'s lock (creating the directory unless it must exist: `create`), or
        raises a one-line FastdraftError naming the live holder or what is in the way."""
        check_output_dir(path, "run", setting, overwrite=overwrite)
        created = not path.exists()
        if created and not create:
            raise FileNotFoundError(f"{setting} {path}: no such run directory")
        writable_dir(Place(path, setting))   # a file in the way / read-only disk: one line
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise FastdraftError(f"{setting} {path} is in use by {holder}: one process writes a "
                                 f"run directory at a time; wait for it to end (or stop it), or "
                                 f"choose another {setting}") from None
        stale = _read(fd)
        if stale:
            print(f"fastdraft: {setting} {path}: its lock named {_describe(stale)}, which ended "
                  "without releasing it (killed or crashed); taken over", file=sys.stderr)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "command": " ".join(["fastdraft", *sys.argv[1:]]),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        mark(path, "run")
        return cls(path, fd, created)

    def release(self) -> None:
        """Clears the holder and drops the lock; a directory the claim made that holds nothing
        else is removed."""
        if self._fd < 0:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1
        if self._created and {p.name for p in self.path.iterdir()} <= {MARKER, LOCK_FILE}:
            for name in (MARKER, LOCK_FILE):
                (self.path / name).unlink(missing_ok=True)
            self.path.rmdir()

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def check_run_dir_free(path: Path, setting: str = "--run-dir", overwrite: bool = False) -> None:
    """What claim() would refuse for an existing `path` (a live holder, files fastdraft did
    not write), checked without creating or taking anything: the dry run's."""
    if not path.exists():
        return
    check_output_dir(path, "run", setting, overwrite=overwrite)
    lock = path / LOCK_FILE
    if not lock.is_file():
        return
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise FastdraftError(f"{setting} {path} is in use by {_describe(_read(fd))}: one process "
                             f"writes a run directory at a time; wait for it to end (or stop "
                             f"it), or choose another {setting}") from None
    finally:
        os.close(fd)


def _read(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return {}


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another fastdraft process (its lock file names none)"
    return (f"pid {holder.get('pid')} on {holder.get('host')} (`{holder.get('command')}`, since "
            f"{holder.get('since')})")
