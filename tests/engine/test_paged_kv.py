"""The paged KV cache (engine/paged_kv.py): completions are those of static slots; a GRPO group
holds its prompt's blocks by reference; moves and finishes move table rows, never K/V; a pool
too small for the batch preempts and recomputes, and every request still finishes exactly as
it would have uninterrupted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.engine.paged_kv import PagedKV
from fastdraft.engine.scheduler import SlotMove
from fastdraft.models import ModelConfig

EAGLE = SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)


def _prompts(groups: int, size: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 30, (groups,), generator=g).tolist()
    return [p for n in lengths for p in [torch.randint(3, 60, (n,), generator=g).tolist()] * size]


def _logprobs(completions) -> torch.Tensor:
    return torch.tensor([lp for c in completions for lp in c.logprobs])


@pytest.mark.parametrize("spec", [None, EAGLE], ids=["plain", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_completions_are_the_static_slots_completions(tiny_checkpoint, random_drafter,
                                                            spec, temperature):
    path, _ = tiny_checkpoint
    engines = [RolloutEngine(path, "cpu", max_batch_size=12, max_seq_len=96,
                             drafter=random_drafter if spec else None, spec=spec,
                             kv_block_size=size) for size in (0, 16, 5)]
    prompts = _prompts(4, 4)
    params = SamplingParams(temperature=temperature, max_new_tokens=40, seed=5)
    static, *paged = [e.generate(prompts, params, use_tqdm=False) for e in engines]
    for out in paged:
        assert [c.token_ids for c in out] == [c.token_ids for c in static]
        assert torch.allclose(_logprobs(out), _logprobs(static), atol=1e-5)


def test_a_group_holds_its_prompt_blocks_by_reference(tiny_checkpoint):
    path, _ = tiny_checkpoint
    engine = RolloutEngine(path, "cpu", max_batch_size=8, max_seq_len=64, kv_block_size=4)
    pages = engine.runner.pages
    seen = []
    real_prefill = engine.runner.prefill

    def prefill(prompts, slot_start, aux_layers=(), rows=None):
        out = real_prefill(prompts, slot_start, aux_layers, rows)
        seen.append([list(pages.slots[s].blocks) for s in range(8) if pages.slots[s]])
        return out
    engine.runner.prefill = prefill
    prompt = list(range(3, 13))   # 10 tokens: 2 full blocks and a partial one
    engine.generate([prompt] * 4 + [list(range(20, 30))] * 4,
                    SamplingParams(temperature=1.0, max_new_tokens=8), use_tqdm=False)
    [tables] = seen
    assert tables[0] == tables[1] == tables[2] == tables[3] and len(tables[0]) == 3
    assert not set(tables[0]) & set(tables[4])
    assert pages.num_free == pages.num_blocks   # every block back once the call ended


def test_moves_and_releases_move_table_rows_and_free_blocks():
    cfg = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                      model_type="qwen2")
    pages = PagedKV(cfg, num_slots=3, cache_len=16, block_size=4, num_blocks=10,
                    dtype=torch.float32, device=torch.device("cpu"))
    pages.admit(0, [1, 2, 3, 4, 5])
    pages.fork(1, 0)
    pages.admit(2, [7])
    rows = pages.table.clone()
    assert rows[0].tolist()[:2] == rows[1].tolist()[:2] and rows[0, 2] == pages.sink
    pages.reserve([6, 6, 2])   # slot 1 writes into the shared block: it gets its own copy
    assert pages.table[0, 1] != pages.table[1, 1] and pages.table[0, 0] == pages.table[1, 0]
    pages.release([0])
    pages.move([SlotMove(2, 0, 1)])
    assert pages.table[0].tolist() == rows[2].tolist()
    assert (pages.table[2] == pages.sink).all()
    pages.release([0, 1])
    assert pages.num_free == 10
    pages.admit(0, [1] * 9)
    pages.admit(0, [2] * 3)   # a slot admitted again gives back what it held
    assert pages.num_free == 9


def test_a_pool_smaller_than_one_sequence_is_refused_with_the_fix():
    cfg = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                      model_type="qwen2")
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gb"):
        PagedKV(cfg, num_slots=3, cache_len=64, block_size=16, num_blocks=4,
                dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("spec", [None, EAGLE], ids=["plain", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preempted_requests_finish_as_if_never_interrupted(tiny_checkpoint, random_drafter,
                                                           spec, temperature):
    path, _ = tiny_checkpoint
    kwargs = dict(max_batch_size=12, max_seq_len=96, kv_block_size=8,
                  drafter=random_drafter if spec else None, spec=spec)
    roomy = RolloutEngine(path, "cpu", **kwargs)
    tight = RolloutEngine(path, "cpu", kv_blocks=30, **kwargs)   # 240 cells for 12 rows
    prompts = _prompts(3, 4)
    params = SamplingParams(temperature=temperature, max_new_tokens=60, ignore_eos=True, seed=7)
    captured = {"roomy": [], "tight": []}
    expected = roomy.generate(prompts, params, use_tqdm=False,
                              on_hidden=captured["roomy"].append)
    assert roomy.last_trace.preemptions == 0
    got = tight.generate(prompts, params, use_tqdm=False, on_hidden=captured["tight"].append)
    assert tight.last_trace.preemptions >= 3
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert torch.allclose(_logprobs(got), _logprobs(expected), atol=1e-5)
    # The drafter's training data: every position of every request once, as without breaks.
    for name, records in captured.items():
        positions = sorted((r.request_index, int(p)) for r in records for p in r.positions)
        assert positions == sorted(set(positions)), name
    assert len({(r.request_index, int(p)) for r in captured["tight"] for p in r.positions}) == \
        len({(r.request_index, int(p)) for r in captured["roomy"] for p in r.positions})


@pytest.mark.parametrize("spec", ["plain", "suffix"])
def test_the_triton_paged_attention_completes_as_the_gather(tiny_checkpoint, spec):
    """paged_attention='triton': decode and verify steps read each row's blocks in place with
    the kernel (on the CPU, Triton's interpreter in a fresh process: it must be on before
    triton is imported); the completions are the gather path's."""
    pytest.importorskip("triton")
    path, _ = tiny_checkpoint
    run = subprocess.run([sys.executable, "-c", _TRITON_STEPS, str(path), spec], cwd=_ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["tokens"]["triton"] == out["tokens"]["gather"]
    assert out["max_logprob_diff"] < 1e-4 and out["steps"] > 5
    if spec == "suffix":   # trees verified, and drafts accepted: their logits counted
        assert out["verify_steps"] > 3 and out["accepted_drafts"] > 5
    assert out["kernel_calls"] == out["steps"] * out["layers"]   # every layer of every step


def test_the_triton_decode_attention_is_refused_where_it_cannot_run(tiny_checkpoint):
    path, _ = tiny_checkpoint
    with pytest.raises(ValueError, match="set kv_block_size"):
        RolloutEngine(path, "cpu", max_seq_len=64, kv_block_size=0, paged_attention="triton")
    with pytest.raises(ValueError, match="power of two"):
        RolloutEngine(path, "cpu", max_seq_len=64, kv_block_size=12, paged_attention="triton")
    with pytest.raises(ValueError, match="'gather' or 'triton'"):
        RolloutEngine(path, "cpu", max_seq_len=64, paged_attention="flash")


_ROOT = Path(__file__).resolve().parents[2]
_TRITON_STEPS = """
import json, sys
import torch
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
g = torch.Generator().manual_seed(4)
prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
params = SamplingParams(greedy=True, max_new_tokens=14, ignore_eos=True)
spec = (None if sys.argv[2] == "plain" else
        SpecConfig(method=sys.argv[2], depth=3, topk=2, tokens_to_verify=6))
out, logprobs, steps, calls = {}, {}, 0, [0]
for name in ("gather", "triton"):
    engine = RolloutEngine(sys.argv[1], "cpu", max_batch_size=4, max_seq_len=64,
                           kv_block_size=8, paged_attention=name,
                           spec=spec)
    kernel = engine.runner.paged_attention
    if kernel is not None:   # count its calls: every decode and verify step must run through it
        def counted(*args, kernel=kernel):
            calls[0] += 1
            return kernel(*args)
        engine.runner.paged_attention = counted
    done = engine.generate(prompts, params, use_tqdm=False)
    out[name] = [c.token_ids for c in done]
    logprobs[name] = torch.tensor([lp for c in done for lp in c.logprobs])
    arms = engine.last_trace.arms
    steps = sum(arm != "prefill" for arm in arms)
    verify_steps = sum(arm not in ("prefill", "off") for arm in arms)
diff = float((logprobs["triton"] - logprobs["gather"]).abs().max())
print(json.dumps({"tokens": out, "max_logprob_diff": diff, "steps": steps,
                  "verify_steps": verify_steps, "kernel_calls": calls[0],
                  "accepted_drafts": engine.last_stats.num_accepted,
                  "layers": engine.config.num_hidden_layers}))
"""


def test_the_triton_kernel_verifies_trees_as_the_gather(tiny_checkpoint):
    """Every node's logits of a split verify step (random trees beside plain decode rows) are
    the gather path's: the kernel's tree mask, per-row lengths and block tables (under the
    interpreter, as above)."""
    pytest.importorskip("triton")
    path, _ = tiny_checkpoint
    run = subprocess.run([sys.executable, "-c", _TRITON_VERIFY, str(path)], cwd=_ROOT,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["kernel_calls"] == 2 * out["layers"]     # the tree rows and the plain rows
    assert out["tree_diff"] < 1e-4 and out["plain_diff"] < 1e-4, out


_TRITON_VERIFY = """
import json, random, sys
import torch
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.config.engine import SpecConfig
from fastdraft.models import load_model
from tests.engine.test_verify_split import _tree
rng = random.Random(0)
model = load_model(sys.argv[1])
envelope = Envelope.for_spec(64, SpecConfig(method="eagle", depth=4, topk=2, tokens_to_verify=6))
runner = ModelRunner(model, envelope, num_slots=5, block_size=4, paged_attention="triton")
prompts = [[rng.randrange(3, 64) for _ in range(n)] for n in (7, 12, 3, 9, 15)]
for slot, prompt in enumerate(prompts):
    runner.pages.admit(slot, prompt)
kernel, calls = runner.paged_attention, [0]
def counted(*args):
    calls[0] += 1
    return kernel(*args)
with torch.inference_mode():
    runner.prefill(prompts, 0)
    root_ids = torch.tensor([rng.randrange(3, 64) for _ in prompts])
    root_pos = torch.tensor([len(p) for p in prompts])
    drafts = DraftBatch.from_trees([_tree(rng, 6), _tree(rng, 6)])
    runner.pages.reserve([len(p) + 1 + 6 for p in prompts[:2]] +
                         [len(p) + 1 for p in prompts[2:]])
    outs = {}
    for name, attention in (("triton", counted), ("gather", None)):
        runner.paged_attention = attention
        outs[name] = runner.verify_split(root_ids, root_pos, drafts, ctx_len=30,
                                         plain_ctx_len=20)
(tree, _), (plain, _) = outs["triton"]
(tree_ref, _), (plain_ref, _) = outs["gather"]
print(json.dumps({"tree_diff": float((tree - tree_ref).abs().max()),
                  "plain_diff": float((plain - plain_ref).abs().max()),
                  "kernel_calls": calls[0], "layers": model.config.num_hidden_layers}))
"""
