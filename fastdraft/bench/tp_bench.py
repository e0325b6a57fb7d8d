"""`fastdraft bench tp`: the native engine over k tensor-parallel ranks (models/tensor_parallel.py)
against one rank, side by side: a plain decode step and a speculative cycle (draft tree, verify,
accept) at each batch size, and the share of each that the all-reduces take. Random weights of
a mid-size shape (what a CPU decodes in tens of milliseconds), a random EAGLE drafter (the
cycle's cost, not its acceptance, is measured). The arms use the same cores: one rank with
`threads` threads, and k ranks of threads // k each (a rank a process, gloo between them); a
GPU's NCCL ranks need a device each, which one GPU cannot give. The greedy tokens of every arm
must agree (the bench fails otherwise)."""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fastdraft.bench.common import write_json
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.models import CausalLM, ModelConfig, save_model
from fastdraft.models.local_ranks import run_ranks
from fastdraft.models.tensor_parallel import TPRank, check_tensor_parallel

SPEC = SpecConfig(method="eagle", depth=4, topk=2, tokens_to_verify=8)


@dataclass(frozen=True, kw_only=True, slots=True)
class TPBench:
    size: int = 2                     # ranks of the tensor-parallel arm
    threads: int = 2                  # cores every arm uses
    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 8
    intermediate: int = 4096
    vocab: int = 32000
    batch_sizes: tuple[int, ...] = (1, 8)
    new_tokens: int = 32
    prompt_tokens: int = 64
    repeats: int = 3

    def config(self) -> ModelConfig:
        cfg = ModelConfig(model_type="qwen2", vocab_size=self.vocab, hidden_size=self.hidden,
                          intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                          num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                          head_dim=self.hidden // self.heads, qkv_bias=True,
                          max_position_embeddings=1024)
        check_tensor_parallel(cfg, self.size)
        return cfg


def run_tp_bench(cfg: TPBench, json_path: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fastdraft-bench-tp-") as tmp:
        work = Path(tmp)
        _write_checkpoint(cfg, work)
        one = run_ranks(1, _measure, cfg, work, workdir=work, threads=cfg.threads)[0]
        many = run_ranks(cfg.size, _measure, cfg, work, workdir=work,
                         threads=max(cfg.threads // cfg.size, 1))
    if any(rank["tokens"] != many[0]["tokens"] for rank in many) or (
            many[0]["tokens"] != one["tokens"]):
        raise RuntimeError("bench tp: the tensor-parallel ranks' greedy tokens differ from one "
                           "rank's")
    rows = []
    for b in cfg.batch_sizes:
        a, t = one["rows"][b], many[0]["rows"][b]
        rows.append({"batch_size": b, "tp1_decode_ms": a["decode_ms"],
                     f"tp{cfg.size}_decode_ms": t["decode_ms"],
                     "decode_speedup": a["decode_ms"] / t["decode_ms"],
                     "tp1_cycle_ms": a["cycle_ms"], f"tp{cfg.size}_cycle_ms": t["cycle_ms"],
                     "cycle_speedup": a["cycle_ms"] / t["cycle_ms"],
                     "all_reduce_share_decode": t["all_reduce_decode_ms"] / t["decode_ms"],
                     "all_reduce_share_cycle": t["all_reduce_cycle_ms"] / t["cycle_ms"]})
    out = {"config": asdict(cfg), "rows": rows}
    print("\n".join(table_lines(out)))
    if json_path is not None:
        write_json(json_path, out)
    return out


def table_lines(out: dict[str, Any]) -> list[str]:
    cfg = out["config"]
    k = cfg["size"]
    lines = [f"tensor parallelism on {cfg['threads']} core(s): 1 rank x {cfg['threads']} "
             f"threads vs {k} ranks x {max(cfg['threads'] // k, 1)} (gloo); hidden "
             f"{cfg['hidden']}, {cfg['layers']} layers, random weights, {cfg['new_tokens']} "
             "new tokens a row",
             f"{'batch':>5} | {'decode ms':>17} {'ratio':>6} {'all-reduce':>10} | "
             f"{'spec cycle ms':>17} {'ratio':>6} {'all-reduce':>10}",
             f"{'':>5} | {'tp1':>8} {f'tp{k}':>8} {'':>6} {'share':>10} | "
             f"{'tp1':>8} {f'tp{k}':>8} {'':>6} {'share':>10}"]
    for r in out["rows"]:
        lines.append(f"{r['batch_size']:>5} | {r['tp1_decode_ms']:>8.2f} "
                     f"{r[f'tp{k}_decode_ms']:>8.2f} {r['decode_speedup']:>5.2f}x "
                     f"{r['all_reduce_share_decode']:>10.0%} | {r['tp1_cycle_ms']:>8.2f} "
                     f"{r[f'tp{k}_cycle_ms']:>8.2f} {r['cycle_speedup']:>5.2f}x "
                     f"{r['all_reduce_share_cycle']:>10.0%}")
    return lines


def _write_checkpoint(cfg: TPBench, out: Path) -> None:
    torch.manual_seed(0)
    model = CausalLM(cfg.config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    save_model(model, out / "policy")
    save_drafter(build_drafter("eagle1", model.config, 1024).attach(model), out / "drafter")


class _AllReduceClock:
    """Seconds this process spends in all-reduces (the row-parallel layers' only collective)."""

    def __init__(self) -> None:
        self.seconds, self._real = 0.0, dist.all_reduce

    def __enter__(self) -> _AllReduceClock:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        dist.all_reduce = timed
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._real


def _measure(tp: TPRank, cfg: TPBench, work: Path) -> dict[str, Any]:
    """On each rank: per batch size, the median time of an engine step (plain) and a cycle
    (speculative) over `repeats` generate calls, and the all-reduces' time in them."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab, (cfg.prompt_tokens,), generator=g).tolist()
               for _ in range(max(cfg.batch_sizes))]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.new_tokens, ignore_eos=True)
    max_seq = cfg.prompt_tokens + cfg.new_tokens + 16
    engines = {"decode": RolloutEngine(work / "policy", max_batch_size=max(cfg.batch_sizes),
                                       max_seq_len=max_seq, tp=tp),
               "cycle": RolloutEngine(work / "policy", max_batch_size=max(cfg.batch_sizes),
                                      max_seq_len=max_seq, tp=tp, spec=SPEC,
                                      drafter=work / "drafter")}
    rows: dict[int, dict[str, float]] = {}
    tokens = None
    for b in cfg.batch_sizes:
        row = {}
        for name, engine in engines.items():
            engine.generate(prompts[:b], greedy)   # warm-up
            per_step, reduce_per_step = [], []
            for _ in range(cfg.repeats):
                with _AllReduceClock() as clock:
                    start = time.perf_counter()
                    out = engine.generate(prompts[:b], greedy)
                    elapsed = time.perf_counter() - start
                steps = len(engine.last_trace.times)
                per_step.append(1e3 * elapsed / steps)
                reduce_per_step.append(1e3 * clock.seconds / steps)
            row[f"{name}_ms"] = statistics.median(per_step)
            row[f"all_reduce_{name}_ms"] = statistics.median(reduce_per_step)
            if name == "decode" and b == max(cfg.batch_sizes):
                tokens = [c.token_ids for c in out]
        rows[b] = row
    return {"rows": rows, "tokens": tokens}
