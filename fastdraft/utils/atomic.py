"""Atomic writes: readers (and a restarted run) see the old result or the whole new one, never a
half-written file or directory, even if the process is killed mid-write. A published directory
carries fastdraft's marker of what it holds (utils/outputs.py), and replaces only a path that
fastdraft may replace."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastdraft.errors import FastdraftError
from fastdraft.utils.outputs import mark, replaceable


def publish_dir(tmp: str | Path, final: str | Path, kind: str, overwrite: bool = False) -> None:
    """Renames a finished temp dir onto `final`, marked as holding `kind`; an existing `final`
    (empty, or fastdraft's own `kind`; anything with `overwrite`) is moved aside first (a
    directory cannot be replaced in one rename) and removed after."""
    final = Path(final)
    if not overwrite and not replaceable(final, kind):
        raise FastdraftError(f"{final} exists and fastdraft did not write it as a {kind}: not "
                             "replaced; choose another path or remove it")
    mark(tmp, kind)
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, old / "x")
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)


@contextmanager
def atomic_dir(final: str | Path, tmp: str | Path | None = None, *, kind: str,
               overwrite: bool = False) -> Iterator[Path]:
    """Yields a temp dir beside `final` (`tmp`: one made already, by temp_dir_for); fill it,
    and on a clean exit it replaces `final` (publish_dir: `kind` and `overwrite`). On an error
    the temp dir is removed and `final` is untouched."""
    final = Path(final)
    tmp = Path(tmp) if tmp is not None else temp_dir_for(final)
    try:
        yield tmp
        publish_dir(tmp, final, kind, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temp_dir_for(final: str | Path) -> Path:
    """A new temp dir beside `final`, named after it (what atomic_dir publishes)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Temp file in the same directory (same filesystem), fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_tree(root: str | Path) -> None:
    """fsyncs every file under `root`, then every directory bottom-up. Call it before the rename
    that publishes `root`: a rename can reach the disk before the data it names, so without this
    a power loss right after publishing could leave a complete-looking directory of empty files."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def fsync_dir(path: str | Path) -> None:
    """fsyncs a directory's entries (after a rename or create inside it) so they survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
