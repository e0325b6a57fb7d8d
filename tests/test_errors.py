"""errors.py: an OS error on a directory the user chose is one line naming the path, the setting
and what to do; found behind the errors it caused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fastdraft.errors import (
    FastdraftError,
    Place,
    check_free_space,
    describe_os_error,
    os_error_in,
    user_error_line,
    writable_dir,
)


def test_a_file_in_the_way_of_a_run_dir_is_named_with_its_setting(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FastdraftError) as err:
        writable_dir(Place(tmp_path / "afile" / "run", "--run-dir"))
    assert str(err.value) == (f"Not a directory: {tmp_path / 'afile' / 'run'} (under --run-dir "
                              f"{tmp_path / 'afile' / 'run'}): a part of the path is a file, not "
                              "a directory: choose another path")


def test_a_writable_dir_is_made_and_left_clean(tmp_path):
    assert writable_dir(Place(tmp_path / "a" / "b", "--run-dir")) == tmp_path / "a" / "b"
    assert list((tmp_path / "a" / "b").iterdir()) == []


def test_too_little_free_space_says_how_much_is_needed(tmp_path):
    with pytest.raises(FastdraftError, match=r"--run-dir .*MB free on its disk, a checkpoint "
                       r"needs about .* MB"):
        check_free_space(Place(tmp_path, "--run-dir"), 10**18, "a checkpoint")
    check_free_space(Place(tmp_path, "--run-dir"), 1, "a checkpoint")


def test_an_os_error_is_found_behind_the_error_it_caused_and_named_by_its_place():
    cause = OSError(errno.EROFS, os.strerror(errno.EROFS), "/data/runs/x/checkpoints/a")
    err = RuntimeError("write failed")
    err.__cause__ = cause
    places = [Place(Path("/data/runs/x"), "--run-dir"), Place(Path("/data"), "--cache-dir")]
    assert user_error_line(err, places) == (
        "Read-only file system: /data/runs/x/checkpoints/a (under --run-dir /data/runs/x): "
        "choose a directory on a writable filesystem")
    assert user_error_line(RuntimeError("a bug"), places) is None
    assert user_error_line(FastdraftError("say what to change"), places) == "say what to change"
    assert user_error_line(ValueError("a library's complaint"), places) is None   # a bug


def test_an_error_outside_every_place_still_names_its_file():
    err = OSError(errno.EACCES, os.strerror(errno.EACCES), "/elsewhere/f")
    assert describe_os_error(err, []) == ("Permission denied: /elsewhere/f: choose a directory "
                                          "you may write to")


def test_an_error_raised_from_none_hides_the_os_error_it_replaced():
    try:
        try:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/x")
        except OSError:
            raise ValueError("what to change") from None
    except ValueError as err:
        replaced = err
    assert os_error_in(replaced) is None
