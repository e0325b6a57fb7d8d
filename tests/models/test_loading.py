from __future__ import annotations

import json

import pytest
import torch

from fastdraft.models import ModelConfig, load_model, save_model
from tests.conftest import make_tiny_checkpoint


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "src", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path / "sharded")
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(12)[None])[0], hf(ids).logits,
                                   atol=1e-4, rtol=0)


def test_save_roundtrip_keeps_tying_and_config(tmp_path):
    make_tiny_checkpoint(tmp_path / "src")
    model = load_model(tmp_path / "src")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_model(model, tmp_path / "out")
    save_model(model, tmp_path / "out")  # overwriting an existing dir is atomic too
    again = load_model(tmp_path / "out")
    assert again.config == model.config
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_missing_weights_and_bad_config_are_named(tmp_path):
    make_tiny_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf_dict({**cfg, "model_type": "gpt2"})
    for moe in ({"model_type": "qwen3_moe", "num_experts": 128},
                {"model_type": "mixtral", "num_local_experts": 8},
                {"model_type": "qwen2", "num_experts": 60}):
        with pytest.raises(ValueError, match="mixture-of-experts model; fastdraft runs dense"):
            ModelConfig.from_hf_dict({**cfg, **moe})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        ModelConfig.from_hf_dict({**cfg, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_dict({**cfg, "num_key_value_heads": 3})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_old_style_rope_fields_are_read():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    cfg = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
