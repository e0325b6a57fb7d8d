"""Tensor parallelism in the native engine (models/tensor_parallel.py) on this CPU: a replica
over two gloo ranks against the same engine on one. The miniature's Qwen3 policy (4 heads, 2 KV
heads: one KV head a rank) in fp32: greedy completions token-identical with logprobs within
1e-5, speculative greedy equal to plain greedy, a weight push landing in every rank's slices bit
for bit (the sampled law at TP 2: tests/engine/spec/test_tp_lossless_stats.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter.warmup import WarmupConfig, warmup_drafter
from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig, load_model
from fastdraft.models.local_ranks import run_ranks
from fastdraft.models.tensor_parallel import TPRank, check_tensor_parallel, local_tensor

pytestmark = pytest.mark.slow
SPEC = SpecConfig(method="eagle", depth=4, topk=2, tokens_to_verify=8)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
MAX_SEQ = 256


@pytest.fixture(scope="module")
def miniature(tmp_path_factory):
    """(policy dir, an EAGLE-3 drafter for it, 12 of the miniature task's prompts)."""
    from transformers import AutoTokenizer

    from fastdraft.bootstrap.run import run_bootstrap
    from fastdraft.config import load_recipe
    from fastdraft.data.prompts import PromptSource
    policy = run_bootstrap(None, spec="tiny-qwen3").policy_dir
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "tiny-qwen3-eagle3.yaml")
    source = PromptSource(recipe.data, AutoTokenizer.from_pretrained(policy), 90)
    out = tmp_path_factory.mktemp("tp-drafter")   # a short warm-up: drafts worth verifying
    warmup_drafter(policy, out, [item.ids for item in source.batch(1, 32)],
                   WarmupConfig(kind="eagle3", num_rollouts=32, max_new_tokens=64, steps=30,
                                warmup_steps=10, batch_size=16))
    return policy, out, [item.ids for item in source.batch(0, 12)]


def _serve(tp: TPRank | None, policy: Path, drafter: Path, prompts: list[list[int]],
           pushed: list[tuple[str, torch.Tensor]]) -> dict:
    """On each rank (tp None: one process): plain and speculative greedy, then a weight push
    and plain greedy on the pushed weights."""
    plain = RolloutEngine(policy, max_batch_size=8, max_seq_len=MAX_SEQ, tp=tp)
    spec = RolloutEngine(policy, max_batch_size=8, max_seq_len=MAX_SEQ, tp=tp, spec=SPEC,
                         drafter=drafter)
    out = {"plain": plain.generate(prompts, GREEDY), "spec": spec.generate(prompts, GREEDY),
           "accepted": spec.last_stats.num_accepted}
    plain.load_weights(pushed)
    out["weights"] = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    out["pushed"] = plain.generate(prompts, GREEDY)
    return out


def _pushed(policy: Path) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(1)
    return [(n, p.detach() + 0.01 * torch.randn_like(p))
            for n, p in load_model(policy).named_parameters()]


def _tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_tp2_serves_the_policy_tp1_serves(miniature, tmp_path):
    policy, drafter, prompts = miniature
    pushed = _pushed(policy)
    one = _serve(None, policy, drafter, prompts, pushed)
    ranks = run_ranks(2, _serve, policy, drafter, prompts, pushed, workdir=tmp_path)
    for key in ("plain", "spec", "pushed"):   # the ranks of a replica decide alike
        assert _tokens(ranks[0][key]) == _tokens(ranks[1][key])
    two = ranks[0]
    for key in ("plain", "pushed"):
        assert _tokens(two[key]) == _tokens(one[key]), key
        for a, b in zip(two[key], one[key]):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert _tokens(two["spec"]) == _tokens(two["plain"])   # lossless at TP 2
    assert two["accepted"] > 100 and one["accepted"] > 100   # the drafts were used
    # every rank holds its slice of the pushed weights, bit for bit
    for rank, out in enumerate(ranks):
        for name, full in pushed:
            expected = local_tensor(TPRank(rank, 2), name, full)
            assert torch.equal(out["weights"][name], expected), (rank, name)
    assert two["weights"]["model.layers.0.self_attn.k_proj.weight"].shape[0] == 64   # 1 of 2


def test_a_split_that_does_not_divide_the_kv_heads_is_refused():
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=8)
    check_tensor_parallel(cfg, 2)
    with pytest.raises(FastdraftError, match=r"num_key_value_heads \(2\).*one of \[1, 2\]"):
        check_tensor_parallel(cfg, 4)


def test_column_and_row_slices():
    tp = TPRank(1, 2)
    w = torch.arange(24.0).view(4, 6)
    assert torch.equal(local_tensor(tp, "model.layers.0.self_attn.q_proj.weight", w), w[2:])
    assert torch.equal(local_tensor(tp, "model.layers.0.mlp.up_proj.bias", w[0]), w[0, 3:])
    assert torch.equal(local_tensor(tp, "model.layers.3.mlp.down_proj.weight", w), w[:, 3:])
    assert torch.equal(local_tensor(tp, "model.layers.3.self_attn.o_proj.bias", w[0]), w[0])
    assert torch.equal(local_tensor(tp, "lm_head.weight", w), w)


def _greedy(tp: TPRank | None, path: Path, prompts: list[list[int]]) -> list:
    engine = RolloutEngine(path, max_batch_size=4, max_seq_len=64, tp=tp)
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=32))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tp2_serves_llama_and_qwen2_as_tp1_does(model_type, tmp_path):
    """The other dense families (Llama 3.x: no biases; Qwen2 / 2.5: q/k/v biases, sliced with
    their rows)."""
    from tests.conftest import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path / "policy", model_type, seed=5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (4, 11, 23)]
    one = _greedy(None, tmp_path / "policy", prompts)
    two = run_ranks(2, _greedy, tmp_path / "policy", prompts, workdir=tmp_path)[0]
    assert _tokens(two) == _tokens(one)
    for a, b in zip(two, one):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
