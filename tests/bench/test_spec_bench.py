from fastdraft.bench.spec_bench import _roll_out
from fastdraft.engine import SamplingParams
from fastdraft.engine.spec.stats import SpecStats


class _RecordingEngine:
    """Stands in for RolloutEngine: records each generate call's prompts and seed."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], int | None]] = []
        self.last_stats = SpecStats()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list:
        self.calls.append((prompts, params.seed))
        return []


def test_roll_out_gives_every_prompt_its_own_seed_at_any_batch_size() -> None:
    prompts = [[i] for i in range(6)]
    for batch_size in (1, 4):
        engine = _RecordingEngine()
        chunks = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
        _roll_out(engine, chunks, SamplingParams(temperature=1.0, seed=100))
        # generate() seeds request j of a call with seed + j: prompt i gets 100 + i.
        seeds = [seed + j for chunk, seed in engine.calls for j in range(len(chunk))]
        assert seeds == [100 + i for i in range(6)]
