"""A tiny CausalLM + AdamW built straight from an HF-style config (no transformers, so the SIGKILL
child starts fast); shared by the tests and the child process."""

from __future__ import annotations

import torch

from fastdraft.models import CausalLM, ModelConfig


def tiny_model(hidden: int = 64, layers: int = 2, seed: int = 0) -> CausalLM:
    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "eos_token_id": 1,
        "bos_token_id": 2, "tie_word_embeddings": True})
    torch.manual_seed(seed)
    return CausalLM(cfg, max_positions=64)


def train_steps(model: CausalLM, optimizer: torch.optim.Optimizer, steps: int,
                scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    """A few real AdamW steps, so the optimizer has moments and a step count to save."""
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8))
        logits, _ = model(ids, torch.arange(8).expand(2, 8))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
