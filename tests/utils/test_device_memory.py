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
