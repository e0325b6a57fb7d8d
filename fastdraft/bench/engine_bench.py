"""`fastdraft bench engine`: transformers' generate vs RolloutEngine, same model, prompts and greedy
settings, measured side by side in one run (median of repeats)."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from fastdraft.bench.common import median_seconds, print_table, write_json
from fastdraft.engine import RolloutEngine, SamplingParams


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineBenchConfig:
    model_dir: Path
    prompts: list[list[int]]
    batch_sizes: tuple[int, ...] = (1, 16)
    max_new_tokens: int = 128
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise ValueError("repeats and max_new_tokens must be >= 1")
        if len(self.prompts) < max(self.batch_sizes):
            raise ValueError(f"need >= {max(self.batch_sizes)} prompts, got {len(self.prompts)}")


def _hf_generate(hf: Any, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
                 pad: int) -> list[list[int]]:
    """Left-padded batch through HF generate; each output cut after its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=eos, pad_token_id=pad)
    results = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        results.append(row[:cut])
    return results


def run_engine_bench(cfg: EngineBenchConfig, json_path: str | Path | None = None
                     ) -> dict[str, Any]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    hf.eval()
    max_len = max(len(p) for p in cfg.prompts) + cfg.max_new_tokens + 1
    engine = RolloutEngine(cfg.model_dir, max_batch_size=max(cfg.batch_sizes),
                           max_seq_len=max_len)
    eos = sorted(engine.eos_token_ids)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    greedy = SamplingParams(greedy=True, max_new_tokens=cfg.max_new_tokens)
    rows = []
    for bs in cfg.batch_sizes:
        prompts = cfg.prompts[:bs]
        hf_s, hf_out = median_seconds(
            lambda p=prompts: _hf_generate(hf, p, cfg.max_new_tokens, eos, pad), cfg.repeats)
        eng_s, eng_out = median_seconds(
            lambda p=prompts: [c.token_ids for c in engine.generate(p, greedy)], cfg.repeats)
        hf_tokens, eng_tokens = sum(map(len, hf_out)), sum(map(len, eng_out))
        rows.append(dict(batch_size=bs, hf_tokens_per_s=hf_tokens / hf_s,
                         engine_tokens_per_s=eng_tokens / eng_s,
                         ratio=(eng_tokens / eng_s) / (hf_tokens / hf_s),
                         outputs_match=hf_out == eng_out, generated_tokens=eng_tokens,
                         hf_seconds=hf_s, engine_seconds=eng_s))
    print_table(rows, ["batch_size", "hf_tokens_per_s", "engine_tokens_per_s", "ratio",
                       "outputs_match", "generated_tokens"])
    payload = dict(rows=rows, model_dir=str(cfg.model_dir), repeats=cfg.repeats,
                   max_new_tokens=cfg.max_new_tokens, torch=torch.__version__,
                   transformers=transformers.__version__, threads=torch.get_num_threads(),
                   machine=platform.processor() or platform.machine())
    if json_path is not None:
        write_json(json_path, payload)
    return payload
