"""Device capacity: what a plan may use (free, less the margin, less what others keep)."""

from __future__ import annotations

from fastdraft.utils.device_memory import GB, GIB, Capacity, _meminfo, device_capacity, gb


def test_usable_is_free_less_margin_less_reserved():
    cap = Capacity.of("cuda:0", total=80 * GB, free=70 * GB, reserved=10 * GB)
    assert cap.margin == 4 * GB                      # 5% of the device
    assert cap.usable == 56 * GB
    assert Capacity.of("cpu", total=8 * GB).margin == GIB   # at least 1 GiB
    assert Capacity.of("cpu", total=GB).usable == 0          # never negative
    assert cap.describe() == ("56.0 GB usable on cuda:0 (70.0 GB free - 4.0 GB margin - "
                              "10.0 GB reserved)")
    assert gb(116_716_978_176) == "116.7 GB" and gb(2048) == "2.0 KB"


def test_cpu_capacity_is_the_available_ram(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  1000 kB\n"
                       "MemAvailable:    8000000 kB\n")
    assert _meminfo(meminfo) == (16_384_000_000, 8_192_000_000)
    cap = device_capacity("cpu", reserved=GB)
    assert 0 < cap.free <= cap.total and cap.reserved == GB


def _gpu_machine_driver(monkeypatch) -> list[str]:
    """This process as the driver of a GPU node: CUDA visible, not initialised here, and any
    call that would make a CUDA context in this process fails the test."""
    import torch

    made: list[str] = []

    def context(*args, **kwargs):
        made.append("mem_get_info")
        raise AssertionError("the driver made a CUDA context (torch.cuda.mem_get_info)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", context)
    return made


def test_a_driver_reads_a_gpus_memory_in_a_child_and_makes_no_context(monkeypatch):
    import subprocess

    from fastdraft.utils import device_memory
    made = _gpu_machine_driver(monkeypatch)
    asked: list[list[str]] = []

    def child(argv, **kwargs):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="70000000000 80000000000\n",
                                           stderr="")

    monkeypatch.setattr(device_memory.subprocess, "run", child)
    cap = device_capacity("cuda:3", in_child=True)
    assert (cap.device, cap.free, cap.total) == ("cuda:3", 70 * GB, 80 * GB) and not made
    assert asked[0][-1] == "3"   # the child reads the same device
    # A process that computes on its GPU reads it itself (its context exists or will).
    import pytest
    with pytest.raises(AssertionError, match="made a CUDA context"):
        device_capacity("cuda:0")


def test_a_child_that_cannot_read_the_gpu_is_one_clear_line(monkeypatch):
    """A real child on this CPU-only torch: its mem_get_info fails, the driver says so."""
    import pytest

    from fastdraft.errors import FastdraftError
    _gpu_machine_driver(monkeypatch)
    with pytest.raises(FastdraftError, match=r"could not read cuda:0's free memory \(.+\): "
                                             "check the GPU with nvidia-smi"):
        device_capacity("cuda", in_child=True)


def test_the_preflight_of_hybrid_workers_reads_in_a_child(monkeypatch):
    """run/preflight.py asks for the child read exactly where the driver computes on no GPU."""
    from fastdraft.config import load_recipe
    from fastdraft.run import preflight
    seen: list[bool] = []

    def capacity(device, reserved=0, *, in_child=False):
        seen.append(in_child)
        raise StopPreflight

    class StopPreflight(Exception):
        pass

    monkeypatch.setattr(preflight, "device_capacity", capacity)
    import pytest
    for placement, expected in (("hybrid", True), ("separate", False)):
        cfg = load_recipe("recipes/tiny-grpo.yaml", [
            "cluster.backend=ray", f"cluster.placement={placement}",
            "cluster.rollout_workers=2", "actor.num_ranks=2"])
        with pytest.raises(StopPreflight):
            preflight.preflight(cfg, dry=True)   # the cached policy: no training
        assert seen.pop() is expected
