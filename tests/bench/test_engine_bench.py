import json


def test_engine_bench_compares_hf_and_the_engine_side_by_side(tiny_checkpoint, tmp_path):
    from fastdraft.bench.engine_bench import EngineBenchConfig, run_engine_bench

    path, _ = tiny_checkpoint
    prompts = [[3 + (5 * i + j) % 50 for j in range(2 + i)] for i in range(3)]
    cfg = EngineBenchConfig(model_dir=path, prompts=prompts, batch_sizes=(1, 2),
                            max_new_tokens=6, repeats=2, compile=False)
    payload = run_engine_bench(cfg, tmp_path / "engine.json")
    assert [r["batch_size"] for r in payload["rows"]] == [1, 2]
    for row in payload["rows"]:
        assert row["hf_tokens_per_s"] > 0 and row["engine_tokens_per_s"] > 0
        assert row["ratio"] == row["engine_tokens_per_s"] / row["hf_tokens_per_s"]
        assert row["outputs_match"] is True  # same greedy tokens as transformers
        assert "compiled_ratio" not in row
    saved = json.loads((tmp_path / "engine.json").read_text())
    assert saved["device"] and saved["dtype"] == "torch.float32"
