"""`fastdraft bench engine`: transformers' generate vs RolloutEngine, same model, prompts and greedy
settings, measured side by side in one run (median of repeats).

Every row rolls out the same prompts, `batch_size` at a time (batch 1 = one after another), so a
row measures the whole long-tailed workload, not one short answer; the contenders of a row are
timed in turn, repeat by repeat, so machine drift hits them alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from fastdraft.bench.common import device_name, interleaved_medians, print_table, write_json
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineBenchConfig:
    model_dir: Path
    prompts: list[list[int]]
    batch_sizes: tuple[int, ...] = (1, 16)
    max_new_tokens: int = 128
    repeats: int = 3
    compile: bool = True  # also measure the engine with torch.compile'd decode steps
    device: str = "cpu"
    dtype: torch.dtype | None = None  # None: float32 (HF and the engine in the same dtype)

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.max_new_tokens < 1:
            raise FastdraftError("repeats and max_new_tokens must be >= 1")
        if not self.prompts:
            raise FastdraftError("need at least one prompt")


def _hf_generate(hf: Any, prompts: list[list[int]], max_new_tokens: int, eos: list[int],
                 pad: int) -> list[list[int]]:
    """Left-padded batch through HF generate; each output cut after its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, device=hf.device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=hf.device)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, device=hf.device)
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
    dtype = cfg.dtype or torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=dtype)
    hf.to(cfg.device).eval()
    max_len = max(len(p) for p in cfg.prompts) + cfg.max_new_tokens + 1
    engines = {prefix: RolloutEngine(cfg.model_dir, device=cfg.device, dtype=dtype,
                                     max_batch_size=max(cfg.batch_sizes), max_seq_len=max_len,
                                     compile=compiled)
               for prefix, compiled in [("", False), ("compiled_", True)]
               if cfg.compile or not compiled}
    eos = sorted(engines[""].eos_token_ids)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    greedy = SamplingParams(greedy=True, max_new_tokens=cfg.max_new_tokens)
    rows = []
    for bs in cfg.batch_sizes:
        chunks = [cfg.prompts[i: i + bs] for i in range(0, len(cfg.prompts), bs)]

        def run_hf(chunks: list[list[list[int]]] = chunks) -> list[list[int]]:
            return [o for c in chunks for o in _hf_generate(hf, c, cfg.max_new_tokens, eos, pad)]

        def run_engine(engine: RolloutEngine, chunks: list[list[list[int]]] = chunks
                       ) -> list[list[int]]:
            return [o.token_ids for c in chunks for o in engine.generate(c, greedy)]

        # warmup=2: a compiled engine compiles on its first calls of each shape
        timed = interleaved_medians(
            {"hf": run_hf, **{prefix: (lambda e=engine: run_engine(e))
                              for prefix, engine in engines.items()}}, cfg.repeats, warmup=2)
        hf_s, hf_out = timed.pop("hf")
        hf_tps = sum(map(len, hf_out)) / hf_s
        row: dict[str, Any] = dict(batch_size=bs, hf_tokens_per_s=hf_tps)
        for prefix, (eng_s, eng_out) in timed.items():
            eng_tps = sum(map(len, eng_out)) / eng_s
            row.update({f"{prefix}engine_tokens_per_s": eng_tps, f"{prefix}ratio": eng_tps / hf_tps,
                        f"{prefix}outputs_match": hf_out == eng_out})
        row.update(num_prompts=len(cfg.prompts), generated_tokens=sum(map(len, hf_out)))
        rows.append(row)
    columns = ["batch_size", "hf_tokens_per_s", "engine_tokens_per_s", "ratio", "outputs_match"]
    if cfg.compile:
        columns += ["compiled_engine_tokens_per_s", "compiled_ratio", "compiled_outputs_match"]
    print_table(rows, [*columns, "num_prompts", "generated_tokens"])
    payload = dict(rows=rows, model_dir=str(cfg.model_dir), repeats=cfg.repeats,
                   max_new_tokens=cfg.max_new_tokens, torch=torch.__version__,
                   transformers=transformers.__version__, threads=torch.get_num_threads(),
                   device=device_name(cfg.device),
                   dtype=str(dtype))
    if json_path is not None:
        write_json(json_path, payload)
    return payload
