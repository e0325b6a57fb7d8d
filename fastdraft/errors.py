"""What the CLI tells a user when a command fails: a user error (a FastdraftError raised by a
check, a FileNotFoundError naming a path the user gave, an OS error on a directory the user
chose) is one line that says what to change; anything else (a ValueError a library raised
included) is a bug, told in one line with its traceback in a crash log.

OS errors are recognised through the whole exception chain (a checkpoint write that hit a full
disk arrives as a CheckpointWriteError whose cause is the OSError) and named by the setting that
chose the directory (`--run-dir`, `--cache-dir`, ...), so the user knows what to change."""

from __future__ import annotations

import errno
import os
import shutil
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CRASH_LOG = "crash.log"

#: What to do about an OS error on a chosen directory, by errno.
_REMEDIES = {
    errno.ENOSPC: "free space there or choose a directory on another disk",
    errno.EDQUOT: "free space there (the disk quota is full) or choose another directory",
    errno.EROFS: "choose a directory on a writable filesystem",
    errno.EACCES: "choose a directory you may write to",
    errno.EPERM: "choose a directory you may write to",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another path",
    errno.EEXIST: "a file is in the way of a directory: choose another path",
}


class FastdraftError(ValueError):
    """A user error whose message says what to change (the CLI prints it as one line, exit 2).
    A ValueError too, so a caller that validates its input by catching ValueError sees it."""


@dataclass(frozen=True)
class Place:
    """A directory a command writes under, and the setting that chose it."""
    path: Path
    setting: str


def writable_dir(place: Place) -> Path:
    """Creates the directory and proves it takes a file, before any work is spent: a read-only
    or full disk, or a file in the way, is one line naming the path and the setting."""
    try:
        place.path.mkdir(parents=True, exist_ok=True)
        probe = place.path / f".fastdraft-probe-{os.getpid()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as err:
        raise FastdraftError(describe_os_error(err, [place])) from None
    return place.path


def existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_creatable(place: Place) -> None:
    """What writable_dir would refuse, told without creating anything (a dry run's): a file in
    the way, or a directory this process may not write."""
    found = existing_ancestor(place.path)
    code = (errno.ENOTDIR if not found.is_dir() else
            errno.EACCES if not os.access(found, os.W_OK | os.X_OK) else None)
    if code is not None:   # named as writable_dir's mkdir names it: the path asked for
        raise FastdraftError(describe_os_error(OSError(code, os.strerror(code), str(place.path)),
                                               [place]))


def check_free_space(place: Place, need_bytes: int, what: str) -> None:
    """`need_bytes` free under the place, or one line saying how much is missing."""
    free = shutil.disk_usage(place.path).free
    if free < need_bytes:
        raise FastdraftError(
            f"{place.setting} {place.path}: {free / 1e6:,.1f} MB free on its disk, {what} needs "
            f"about {need_bytes / 1e6:,.1f} MB: {_REMEDIES[errno.ENOSPC]}")


def exception_chain(err: BaseException | None, hidden: bool = False
                    ) -> Iterator[BaseException]:
    """err, then what it was raised from or during, and so on. A `raise ... from None` ends the
    chain (what it replaced is not the story) unless `hidden`."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        suppressed = err.__suppress_context__ and not hidden
        err = err.__cause__ or (None if suppressed else err.__context__)


def os_error_in(err: BaseException) -> OSError | None:
    """The first OSError naming a file in err's chain, if any."""
    return next((e for e in exception_chain(err)
                 if isinstance(e, OSError) and e.filename is not None), None)


def describe_os_error(err: OSError, places: list[Place]) -> str:
    """`<reason>: <file> (under <setting> <dir>): <remedy>`."""
    filename = Path(os.fsdecode(err.filename))
    line = f"{err.strerror or err}: {filename}"
    place = next((p for p in places if _within(filename, p.path)), None)
    if place is not None:
        line += f" (under {place.setting} {place.path})"
    remedy = _REMEDIES.get(err.errno or 0)
    return f"{line}: {remedy}" if remedy else line


def user_error_line(err: BaseException, places: list[Place]) -> str | None:
    """The one line for a user error; None for a bug."""
    if isinstance(err, (FastdraftError, FileNotFoundError)):
        return str(err)
    found = os_error_in(err)
    if found is None:
        return None
    # What the OS error stopped, when an error of the chain says (a checkpoint not written).
    what = next((link.what_failed for link in exception_chain(err)
                 if isinstance(getattr(link, "what_failed", None), str)), None)
    line = describe_os_error(found, places)
    return f"{what}: {line}" if what else line


def write_crash_log(err: BaseException, candidates: list[Path]) -> Path | None:
    """The traceback in the first of `candidates` that takes it (None: none did)."""
    text = "".join(traceback.format_exception(err))
    for directory in candidates:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / CRASH_LOG).write_text(text)
            return directory / CRASH_LOG
        except OSError:
            continue
    return None


def _within(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False
