"""SHA256SUMS of a directory: written in sha256sum's format, every file checked, a damaged or
missing one named; a directory without SHA256SUMS (written before digests) is not refused."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from fastdraft.utils.file_digest import SUMS_FILE, CorruptFileError, check_sums, write_sums


def _tree(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(bytes(range(256)) * 64)
    (root / "sub" / "b.json").write_text('{"x": 1}')
    return root


def test_sums_cover_every_file_and_pass(tmp_path):
    root = _tree(tmp_path / "d")
    write_sums(root)
    lines = (root / SUMS_FILE).read_text().splitlines()
    assert [line.split("  ")[1] for line in lines] == ["a.bin", "sub/b.json"]
    assert check_sums(root) is True


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum")
def test_sha256sum_reads_the_same_file(tmp_path):
    root = _tree(tmp_path / "d")
    write_sums(root)
    subprocess.run(["sha256sum", "--quiet", "-c", SUMS_FILE], cwd=root, check=True)


def test_a_same_size_change_and_a_missing_file_are_named(tmp_path):
    root = _tree(tmp_path / "d")
    write_sums(root)
    with (root / "a.bin").open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x00")
    with pytest.raises(CorruptFileError, match=r"a\.bin: its bytes differ"):
        check_sums(root)
    write_sums(root)
    (root / "sub" / "b.json").unlink()
    with pytest.raises(CorruptFileError, match=r"sub/b\.json: missing"):
        check_sums(root)


def test_without_sums_nothing_is_checked(tmp_path):
    assert check_sums(_tree(tmp_path / "d")) is False
