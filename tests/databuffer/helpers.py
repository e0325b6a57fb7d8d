"""Small Samples and a tiny fp32 decoder for the DataBuffer tests."""

from __future__ import annotations

import torch

from fastdraft.databuffer import Sample
from fastdraft.models import CausalLM, ModelConfig

VOCAB = 32


def make_sample(request_index: int, num_tokens: int, *, rl_step: int = 0, hidden_size: int = 4,
                num_aux: int = 0, prompt_len: int = 2, policy_version: int = 0,
                reward: float | None = None, seed: int | None = None) -> Sample:
    """Random tokens and states; loss mask on the tokens after the prompt."""
    g = torch.Generator().manual_seed(seed if seed is not None
                                      else 1000 * rl_step + request_index)
    ids = torch.randint(0, VOCAB, (num_tokens,), generator=g)
    mask = torch.arange(num_tokens) >= prompt_len
    return Sample(request_index=request_index, policy_version=policy_version, rl_step=rl_step,
                  token_ids=ids, positions=torch.arange(num_tokens),
                  hidden=torch.randn(num_tokens, hidden_size, generator=g), loss_mask=mask,
                  aux_hidden=tuple(torch.randn(num_tokens, hidden_size, generator=g)
                                   for _ in range(num_aux)),
                  reward=reward)


def sample_bytes(num_tokens: int, hidden_size: int = 4, num_aux: int = 0) -> int:
    """ids and positions int64, mask bool, hidden (+ aux) bf16."""
    return num_tokens * (8 + 8 + 1 + 2 * hidden_size * (1 + num_aux))


def tiny_lm(seed: int = 0) -> CausalLM:
    """2 layers, GQA (4 query heads over 2 KV heads), qkv bias: Qwen2's switches, fp32."""
    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "eos_token_id": 1, "tie_word_embeddings": True})
    torch.manual_seed(seed)
    model = CausalLM(cfg, max_positions=64)
    with torch.no_grad():
        # Default-init weights; embeddings (tied to lm_head) scaled so logits are O(1): an fp32
        # comparison at 1e-5 then has an order of magnitude of headroom over rounding noise.
        for name, p in model.named_parameters():
            if "embed" in name:
                p.mul_(0.1)
            elif p.dim() == 1:  # norms and biases away from their trivial init
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()
