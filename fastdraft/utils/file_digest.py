"""SHA-256 digests of the files a directory holds, so that damage inside a file of the right size
(a bad disk block, a partial copy, bytes written by hand) is found before the file is loaded.

Run checkpoints record the digests in their COMPLETE marker; drafter checkpoints and exports in
`SHA256SUMS`, in `sha256sum`'s own format (`sha256sum -c SHA256SUMS` checks one by hand). A
directory written before digests were kept has no SHA256SUMS and is read as before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastdraft.errors import FastdraftError

SUMS_FILE = "SHA256SUMS"
_CHUNK = 1 << 22


class CorruptFileError(FastdraftError):
    """A file whose bytes are not the ones recorded when it was written; names the file."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


def file_sha256(path: str | Path) -> str:
    """The hex SHA-256 of a file, read in 4 MiB chunks (checkpoints are larger than RAM)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def tree_files(root: Path, exclude: tuple[str, ...] = (SUMS_FILE,)) -> list[str]:
    """Relative POSIX paths of every file under `root`, sorted; names in `exclude` left out."""
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in exclude]


def write_sums(root: str | Path) -> None:
    """Writes `root/SHA256SUMS` over every other file under `root` (call it last, before the
    directory is published)."""
    root = Path(root)
    lines = [f"{file_sha256(root / rel)}  {rel}\n" for rel in tree_files(root)]
    (root / SUMS_FILE).write_text("".join(lines))


def check_sums(root: str | Path) -> bool:
    """Checks every file `root/SHA256SUMS` lists; raises CorruptFileError naming the first one
    missing or changed. False when there is no SHA256SUMS (written before digests were kept)."""
    root = Path(root)
    sums = root / SUMS_FILE
    if not sums.is_file():
        return False
    for line in sums.read_text().splitlines():
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64:
            raise CorruptFileError(sums, f"unreadable line {line[:80]!r}")
        check_file(root / rel, digest)
    return True


def check_file(path: Path, digest: str) -> None:
    """Raises CorruptFileError unless `path` exists and hashes to `digest`."""
    if not path.is_file():
        raise CorruptFileError(path, "missing")
    if file_sha256(path) != digest:
        raise CorruptFileError(path, "its bytes differ from those written (SHA-256 mismatch): "
                                     "damaged on disk or changed by hand")
