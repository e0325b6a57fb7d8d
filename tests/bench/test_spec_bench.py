from fastdraft.bench.spec_bench import _roll_out, min_verify_steps
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


def test_min_verify_steps_counts_full_trees_after_the_prefill_token() -> None:
    # depth 6: a step yields at most 7 tokens; the first token comes from prefill.
    assert min_verify_steps([8], depth=6) == 1
    assert min_verify_steps([9], depth=6) == 2
    assert min_verify_steps([1, 0], depth=6) == 0          # done at prefill: no step
    assert min_verify_steps([8, 10, 34], depth=6) == 1 + 2 + 5
    assert min_verify_steps([10], depth=1) == 5


def test_spec_bench_runs_every_method_and_reports_unit_costs(tiny_checkpoint, random_drafter,
                                                             tmp_path):
    from fastdraft.bench.spec_bench import SpecBenchConfig, run_spec_bench

    path, _ = tiny_checkpoint
    prompts = [[3 + (7 * i + j) % 50 for j in range(2 + i)] for i in range(3)]
    cfg = SpecBenchConfig(model_dir=path, drafter_dir=random_drafter, prompts=prompts,
                          batch_sizes=(1, 2), depth=3, topk=2, tokens_to_verify=5,
                          max_new_tokens=8, repeats=1)
    payload = run_spec_bench(cfg, tmp_path / "spec.json")
    rows = payload["rows"]
    assert {(r["method"], r["batch_size"], r["temperature"]) for r in rows} == {
        (m, b, t) for m in ("none", "eagle", "suffix") for b in (1, 2) for t in (0.0, 1.0)}
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["speedup_vs_none"] > 0
        # Lossless: every speculative greedy row reproduces plain greedy decoding.
        assert row["outputs_match"] is (True if row["temperature"] == 0.0 else None)
        if row["method"] == "none":
            assert row["verify_steps"] is None and row["min_verify_steps"] is None
        else:  # no drafter beats the floor its tree depth sets
            assert row["verify_steps"] >= row["min_verify_steps"] > 0
    # Greedy suffix drafting over an earlier greedy rollout of the same prompt knows every
    # answer: it takes exactly the floor, so the floor is tight.
    suffix_greedy = [r for r in rows if r["method"] == "suffix" and r["temperature"] == 0.0]
    assert all(r["verify_steps"] == r["min_verify_steps"] for r in suffix_greedy)
    costs = payload["unit_costs"]
    assert set(costs) == {f"{s}_ms" for s in ("decode", "draft_tree", "verify", "commit", "cycle")
                          } | {f"{s}_over_decode" for s in ("draft_tree", "verify", "commit",
                                                            "cycle")}
    assert all(v > 0 for v in costs.values())
    assert (tmp_path / "spec.json").is_file()
