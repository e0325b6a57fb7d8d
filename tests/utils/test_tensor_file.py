"""A damaged .safetensors file is told by its header, before anything loads it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from fastdraft.errors import FastdraftError
from fastdraft.models.loading import weight_files
from fastdraft.utils.tensor_file import check_safetensors, damaged_safetensors


@pytest.fixture
def whole(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64), "b": torch.zeros(3, 5)}, str(path))
    return path


def test_a_whole_file_passes(whole):
    assert damaged_safetensors(whole) is None
    assert weight_files(whole.parent) == [whole]


@pytest.mark.parametrize("cut, why", [
    (4, "shorter than a safetensors header"),
    (20, "its header claims"),
    (-1, "its header describes"),
])
def test_a_truncated_file_is_named_with_why(whole, cut, why):
    data = whole.read_bytes()
    whole.write_bytes(data[:cut])
    assert why in damaged_safetensors(whole)
    with pytest.raises(FastdraftError, match=rf"model.path: {whole} is damaged \(.*{why}"):
        check_safetensors(whole, "model.path")
    with pytest.raises(FastdraftError, match=f"checkpoint {whole.parent}: {whole} is damaged"):
        weight_files(whole.parent)


def test_a_file_with_bytes_appended_or_a_garbled_header_is_damaged(whole):
    data = whole.read_bytes()
    whole.write_bytes(data + b"\0" * 10)
    assert "its header describes" in damaged_safetensors(whole)
    whole.write_bytes(data[:8] + b"x" * (len(data) - 8))
    assert "not JSON" in damaged_safetensors(whole)
