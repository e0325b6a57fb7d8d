from fastdraft.models.attn_meta import AttnMeta, KVView, causal_cache_meta
from fastdraft.models.config import ModelConfig
from fastdraft.models.decoder import CausalLM, HiddenStates
from fastdraft.models.loading import load_model, load_named_tensors, save_model

__all__ = ["AttnMeta", "CausalLM", "HiddenStates", "KVView", "ModelConfig", "causal_cache_meta",
           "load_model", "load_named_tensors", "save_model"]
