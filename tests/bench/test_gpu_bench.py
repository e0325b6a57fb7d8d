"""`bench gpu` measures on CUDA only, but how it drives the engine runs anywhere: a batch
prefilled and ready to decode, and a second batch started over one left unfinished (the bench
moves from batch size to batch size without finishing its requests)."""

from __future__ import annotations

from fastdraft.bench.gpu_bench import start_decoding
from fastdraft.engine import RolloutEngine


def test_start_decoding_leaves_a_batch_ready_to_decode_again_and_again(tiny_checkpoint):
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, "cpu", max_batch_size=8, max_seq_len=64)
    first = start_decoding(engine, batch=6, prompt_len=10, max_new=40)
    assert len(first.running) == 6 and not first.waiting
    assert all(len(r.output_token_ids) == 1 for r in first.running)
    for size in (8, 8, 3):   # each over the last one's unfinished requests
        scheduler = start_decoding(engine, batch=size, prompt_len=30, max_new=30)
        engine.step(scheduler)
        assert [len(r.output_token_ids) for r in scheduler.running] == [2] * size
