"""`fastdraft bench update`: the actor's update (forward, GRPO loss, backward of every
micro-batch) on a long-tailed batch (one long answer among short ones), three ways side by side:
- `padded_full`: right-padded rows grouped by length, the whole micro-batch's logits at once
  (the actor before issue 41);
- `padded_chunked`: padded rows, answer-token logits in chunks (algo/answer_scores.py);
- `packed_chunked`: sequences packed without padding, logits in chunks (today's default).
Each arm runs in a process of its own (its peak resident memory, or on a GPU its peak
allocation, is its own); the arms' losses must agree (the bench fails otherwise). Reported:
seconds per update (median of the repeats), peak memory, the tokens the forwards computed
(padding included), and packed / padded ratios."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fastdraft.algo.answer_scores import AnswerScores, ScoreSpec
from fastdraft.algo.logprobs import logprobs_of, next_token_logits
from fastdraft.algo.objective import Algorithm
from fastdraft.algo.sequences import SequenceBatch, build_batch, micro_batches
from fastdraft.algo.token_stats import token_stats
from fastdraft.bench.common import write_json
from fastdraft.config.sections import AlgorithmConfig
from fastdraft.models import CausalLM
from fastdraft.utils.device_memory import process_peak_bytes

ARMS = ("padded_full", "padded_chunked", "packed_chunked")


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateBench:
    """shape: a real shape's vocabulary and attention layout (bench/real_shapes.py), its layers
    narrowed to `hidden` / `layers` where given (what a CPU runs in seconds)."""

    shape: str = "qwen2.5-7b"
    hidden: int | None = 256
    layers: int | None = 4
    rows: int = 16
    long_tokens: int = 3000
    prompt_tokens: int = 64
    micro_batch_tokens: int = 8192
    chunk_tokens: int = 4096
    repeats: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0


def long_tailed_batch(cfg: UpdateBench, vocab: int) -> SequenceBatch:
    """rows - 1 answers of 30-200 tokens and one of long_tokens, random ids and advantages."""
    g = torch.Generator().manual_seed(cfg.seed)
    lengths = [*torch.randint(30, 201, (cfg.rows - 1,), generator=g).tolist(), cfg.long_tokens]
    prompts = [torch.randint(3, vocab, (cfg.prompt_tokens,), generator=g).tolist()
               for _ in lengths]
    answers = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    olds = [(-5.0 + 0.1 * torch.randn(n, generator=g)).tolist() for n in lengths]
    return build_batch(prompts, answers, olds, torch.randn(len(lengths), generator=g).tolist())


def _model(cfg: UpdateBench) -> CausalLM:
    from fastdraft.bench.real_shapes import SHAPES
    from fastdraft.models import ModelConfig
    fields = dict(SHAPES[cfg.shape])
    if cfg.hidden is not None:
        heads = max(cfg.hidden // 64, 1)
        fields.update(hidden_size=cfg.hidden, intermediate_size=3 * cfg.hidden,
                      num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1))
    if cfg.layers is not None:
        fields["num_hidden_layers"] = cfg.layers
    torch.manual_seed(cfg.seed)
    model = CausalLM(ModelConfig.from_hf_dict(fields), cfg.prompt_tokens + cfg.long_tokens + 8)
    return model.to(cfg.device, getattr(torch, cfg.dtype))


def run_arm(cfg: UpdateBench, arm: str) -> dict[str, Any]:
    """One arm's updates in this process: {seconds, peak_bytes, loss, computed_tokens}."""
    model = _model(cfg)
    batch = long_tailed_batch(cfg, model.config.vocab_size)
    packed = arm == "packed_chunked"
    groups = micro_batches(batch, cfg.micro_batch_tokens, packed)
    objective = Algorithm(AlgorithmConfig(), 1.0).objective(batch, None)
    spec = ScoreSpec(temperature=1.0, chunk_tokens=cfg.chunk_tokens, packed=packed)
    cuda = cfg.device.startswith("cuda")
    before = process_peak_bytes()
    times, loss = [], 0.0
    for _ in range(cfg.repeats + 1):   # the first warms up
        model.zero_grad(set_to_none=True)
        start, loss = time.perf_counter(), 0.0
        for rows in groups:
            mb = batch.rows(rows).to(cfg.device)
            if arm == "padded_full":   # and the gate's statistics, as that actor made them
                logits = next_token_logits(model, mb.input_ids)
                token_stats(logits.detach(), mb.input_ids[:, 1:], 1.0, mask=mb.mask)
                logprobs = logprobs_of(logits, mb.input_ids, 1.0) * mb.mask
            else:
                logprobs = AnswerScores(mb, spec).forward(model, stats=True)[0]
            part, _ = objective(logprobs, mb)
            part.backward()
            loss += float(part)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if cuda
            else process_peak_bytes() - before)
    lengths = [int(batch.rows([r]).input_ids.shape[1]) for r in range(batch.input_ids.shape[0])]
    computed = sum(sum(lengths[r] for r in g.tolist()) if packed
                   else len(g) * max(lengths[r] for r in g.tolist()) for g in groups)
    return {"seconds": statistics.median(times[1:]), "peak_bytes": peak, "loss": loss,
            "computed_tokens": computed, "micro_batches": len(groups)}


def run_update_bench(cfg: UpdateBench, json_path: Path | None = None) -> dict[str, Any]:
    rows = {}
    for arm in ARMS:   # one process each: its own peak
        out = subprocess.run([sys.executable, "-m", "fastdraft.bench.update_bench", arm,
                              json.dumps(asdict(cfg))], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"bench update: arm {arm} failed:\n{out.stderr[-4000:]}")
        rows[arm] = json.loads(out.stdout.strip().splitlines()[-1])
    losses = [r["loss"] for r in rows.values()]
    if max(losses) - min(losses) > 1e-4 * max(abs(x) for x in losses):
        raise RuntimeError(f"bench update: the arms' losses differ ({losses}): not one update")
    full, packed = rows["padded_full"], rows["packed_chunked"]
    report = {"config": asdict(cfg), "arms": rows,
              "time_ratio_packed_vs_padded": packed["seconds"] / full["seconds"],
              "peak_ratio_packed_vs_padded": packed["peak_bytes"] / full["peak_bytes"],
              "computed_tokens_ratio": packed["computed_tokens"] / full["computed_tokens"]}
    print(f"update of {cfg.rows} rows (one {cfg.long_tokens}-token answer), {cfg.shape} "
          f"vocabulary, micro-batches of {cfg.micro_batch_tokens} tokens, {cfg.device} "
          f"{cfg.dtype}:")
    for arm, r in rows.items():
        print(f"  {arm:15s} {r['seconds']:7.2f} s  peak {r['peak_bytes'] / 2**20:8.0f} MB  "
              f"{r['computed_tokens']:7d} tokens in {r['micro_batches']} micro-batches")
    print(f"  packed / padded_full: time {report['time_ratio_packed_vs_padded']:.3f}, peak "
          f"{report['peak_ratio_packed_vs_padded']:.3f}, tokens "
          f"{report['computed_tokens_ratio']:.3f}")
    write_json(json_path, report)
    return report


if __name__ == "__main__":   # one arm, in its own process (run_update_bench)
    torch.set_num_threads(1)
    print(json.dumps(run_arm(UpdateBench(**json.loads(sys.argv[2])), sys.argv[1])))
