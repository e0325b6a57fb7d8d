import pytest
import torch

from fastdraft.bench.common import interleaved_medians, median_seconds, parse_dtype


def test_interleaved_medians_times_contenders_round_robin() -> None:
    calls: list[str] = []

    def contender(name: str):
        def run() -> str:
            calls.append(name)
            return f"{name}{len(calls)}"
        return run

    timed = interleaved_medians({"a": contender("a"), "b": contender("b")}, repeats=3, warmup=1)
    # one warm-up round, then three timed rounds, each running a then b
    assert calls == ["a", "b"] * 4
    assert set(timed) == {"a", "b"}
    assert timed["a"][1] == "a7" and timed["b"][1] == "b8"  # each contender's last result
    assert all(seconds >= 0.0 for seconds, _ in timed.values())


def test_median_seconds_returns_the_last_result() -> None:
    runs = iter(range(10))
    seconds, result = median_seconds(lambda: next(runs), repeats=3, warmup=2)
    assert result == 4 and seconds >= 0.0


def test_parse_dtype_names_the_choices() -> None:
    assert parse_dtype(None) is None
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        parse_dtype("fp8")
