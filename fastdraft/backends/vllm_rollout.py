"""VllmRollout: rollout.backend=vllm. The user's own vLLM serves the rollouts, with fastdraft's
drafter speculating inside it; the RL loop sees the engine's interface, as with the native
engine or the Ray pool, and does not know which it talks to.

- generate: every request its own seed (the native engine's streams: seed + index), vLLM's
  sampled-token logprobs in `processed_logprobs` mode (after temperature and top-k / top-p:
  the quantity the actor's gate recomputes). Requests are stepped here, not through
  `LLM.generate`, so each finished one reaches the callbacks at once (the online drafter's
  tail trigger) and every engine step is in the trace.
- weights: the actor's tensors go into every vLLM worker in buckets (`collective_rpc` into
  backends/vllm_worker.py), the drafter's the same way under its export names, each with its
  version, which the workers keep and report (`served_versions`).
- statistics: each finished request's verify-step histogram (backends/vllm_stats.py) becomes
  its SpecStats; their sum the step's (`rollout/accept_length`).

A host replica (the native engine on the CPU, one slot, never generating; the Ray pool's
pattern) holds what the rest of fastdraft reads of an engine: the policy and drafter modules
(the online trainer's shapes, embedding and head), versions, the drafter's checksum check, the
state a resume puts back. vLLM hands out no hidden states, so an online drafter learns from the
actor's forward (drafter.online.source=actor). vLLM is imported only here and in vLLM's workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from fastdraft.backends.vllm_args import cpu_thread_binding, vllm_engine_args
from fastdraft.backends.vllm_stats import spec_stats_of
from fastdraft.backends.vllm_worker import serve_positions
from fastdraft.config.engine import SpecConfig
from fastdraft.engine import Completion, RolloutEngine, SamplingParams
from fastdraft.engine.host_front import HostFront
from fastdraft.engine.request import FinishReason
from fastdraft.engine.spec.stats import SpecStats
from fastdraft.engine.trace import RolloutTrace
from fastdraft.errors import FastdraftError
from fastdraft.export import export_drafter
from fastdraft.export.formats import architecture_for
from fastdraft.export.names import to_engine_names
from fastdraft.utils.weight_buckets import decoder_layer, weight_buckets

WORKER_EXTENSION = "fastdraft.backends.vllm_worker.FastdraftWorkerExtension"
PUSH_BUCKET_MB = 64   # a push's blob: bounded host memory, few RPCs


class VllmRollout(HostFront):
    """vLLM serving the rollouts behind the engine's interface, fastdraft's drafter as its EAGLE
    drafter; a host replica of fastdraft's engine takes every update vLLM takes and answers
    what the loop reads of an engine's state (engine/host_front.py)."""

    def __init__(self, host: RolloutEngine, policy_dir: Path, drafter_dir: Path | None,
                 work_dir: Path, *, device: str, max_seq_len: int, max_batch_size: int, dtype: str,
                 seed: int, spec_depth: int, kv_cache_gb: float | None = None,
                 tensor_parallel: int = 1, memory_reserve: int = 0) -> None:
        """tensor_parallel: vLLM's tensor_parallel_size; memory_reserve: bytes of device 0
        the run keeps (backends/vllm_args.py)."""
        import os

        from vllm import LLM
        self.host = host
        self.policy_names = {name for name, _ in host.model.named_parameters()}
        speculative = None
        if drafter_dir is not None:   # EAGLE-3 (the recipe check): one export directory
            kind = host.model_drafter.kind
            self.architecture = architecture_for(kind, "vllm", host.config.model_type)
            # vLLM's own layout (speculators), which names the aux layers as vLLM counts them
            export = work_dir / "vllm-drafter" / "speculators"   # (a resumed run's is there)
            if not export.exists():
                [export] = export_drafter(drafter_dir, policy_dir, export.parent, "speculators",
                                          speculative_tokens=spec_depth)
            # vLLM drafts a chain: fastdraft's tree shape (topk, tokens_to_verify) has no say.
            # Drafts sampled from the drafter's distribution and verified by the ratio test,
            # as fastdraft's engine does (vLLM's default drafts argmax tokens and treats them
            # as certain: sampled rollouts accepted 2.15 tokens a step against 6.0 here).
            speculative = {"method": kind, "model": str(export),
                           "num_speculative_tokens": spec_depth,
                           "draft_sample_method": "probabilistic"}
        if device == "cpu":   # vLLM's CPU build sizes its KV cache from this (GiB)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(math.ceil(kv_cache_gb or 1)))
            if tensor_parallel > 1:   # a worker's threads on its own cores
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(
                    list(os.sched_getaffinity(0)), tensor_parallel))
        gpu = device.startswith("cuda")
        self.llm = LLM(
            model=str(policy_dir), dtype=dtype, seed=seed, max_model_len=max_seq_len,
            hf_overrides=partial(serve_positions, max_seq_len),   # the drafter's too
            speculative_config=speculative, logprobs_mode="processed_logprobs",
            # every finished request's verify steps (backends/vllm_stats.py)
            per_request_spec_decode_metrics="summary" if speculative else "none",
            worker_extension_cls=WORKER_EXTENSION,
            **vllm_engine_args(device=device, tensor_parallel=tensor_parallel,
                               max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                               memory_reserve=memory_reserve, device_bytes=(
                                   torch.cuda.get_device_properties(device).total_memory
                                   if gpu else None)))
        self.fixed_cpu_kernels = any(self.llm.collective_rpc("fastdraft_fix_cpu_kernels"))
        self.last_trace, self.last_stats = RolloutTrace(), SpecStats()
        self.requests = 0   # vLLM request ids are unique over the engine's life

    # the host replica's state calls, which vLLM has no counterpart of
    def advance_step(self) -> None:
        self.host.advance_step()

    def resume_speculation(self, spec: SpecConfig) -> None:
        self.host.resume_speculation(spec)

    def state_dict(self) -> dict:
        return self.host.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.host.load_state_dict(state)

    # ----------------------------------------------------------------------------- rollout
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, *,
                 on_finish: Callable[[Completion], None] | None = None,
                 on_hidden: Any = None, use_tqdm: bool | None = None) -> list[Completion]:
        """One completion per prompt, in prompt order; request i samples from seed + i."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        if on_hidden is not None:
            raise FastdraftError("rollout.backend=vllm captures no hidden states: an online "
                                 "drafter needs drafter.online.source=actor")
        engine, base, n = self.llm.llm_engine, self.requests, len(prompt_token_ids)
        self.requests += n
        stop = sorted(self.host.eos_token_ids)
        for i, prompt in enumerate(prompt_token_ids):
            engine.add_request(str(base + i), TokensPrompt(prompt_token_ids=prompt), VllmParams(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=params.max_new_tokens, logprobs=0,
                seed=None if params.seed is None else params.seed + i,
                stop_token_ids=stop, detokenize=False,
                output_kind=RequestOutputKind.DELTA))   # each step's new tokens: the trace
        trace = RolloutTrace(num_requests=n)
        answers: list[_Answer] = [_Answer() for _ in range(n)]
        done: list[Completion | None] = [None] * n
        try:
            while engine.has_unfinished_requests():
                trace.record(engine.get_num_unfinished_requests())
                produced = 0
                for out in engine.step():
                    index = int(out.request_id) - base
                    produced += answers[index].extend(out.outputs[0])
                    if out.finished:
                        done[index] = completion = answers[index].completion(
                            index, prompt_token_ids[index], self.host)
                        if on_finish is not None:
                            on_finish(completion)
                trace.end_step("vllm", produced)
        except BaseException:   # nothing of this call may leak into the next one
            engine.abort_request([str(base + i) for i in range(n) if done[i] is None])
            raise
        trace.finish()
        trace.prefill_tokens = trace.prefill_computed = sum(map(len, prompt_token_ids))
        self.last_trace = trace
        out = [c for c in done if c is not None]
        self.last_stats = SpecStats()
        for completion in out:
            if completion.spec is not None:
                self.last_stats.merge(completion.spec)
        return out

    # -------------------------------------------------------------------- between steps
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int | None = None) -> int:
        """The policy's new weights (HF names) into the host replica and every vLLM worker:
        all of them, a decoder layer's tensors in one bucket (vLLM's in-place reload rebuilds
        a fused layer, q/k/v or gate/up, only from all of its parts)."""
        version = self.host.policy_version + 1 if version is None else version
        pushed: set[str] = set()
        for bucket in weight_buckets(named_tensors, PUSH_BUCKET_MB * 2**20, decoder_layer):
            self.host.load_weights(bucket, version)
            self._push(bucket, draft=False, version=version)
            pushed.update(name for name, _ in bucket)
        missing = sorted(self.policy_names - pushed)
        if missing:   # what vLLM holds of those layers is now undefined: the run cannot go on
            raise FastdraftError(f"rollout.backend=vllm takes whole policies: {len(missing)} "
                                 f"tensor(s) were not pushed ({', '.join(missing[:3])}, ...)")
        return version

    def load_drafter_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             version: int | None = None, checksum: str | None = None,
                             held_by: int | None = None) -> int:
        """The drafter's trainable tensors (fastdraft names), checksum-checked by the host,
        into every vLLM worker under the names the export gives them."""
        named = [(name, t.detach().cpu()) for name, t in named_tensors]
        version = self.host.load_drafter_weights(named, version, checksum)
        kind = self.host.model_drafter.kind
        self._push(list(to_engine_names(kind, self.architecture, dict(named)).items()),
                   draft=True, version=version)
        return version

    def _push(self, named: list[tuple[str, torch.Tensor]], draft: bool, version: int) -> None:
        blob = save({name: t.contiguous() for name, t in named})   # (host copies already)
        got = self.llm.collective_rpc("fastdraft_load", args=(blob, draft, version))
        if any(answer != (len(named), version) for answer in map(tuple, got)):
            raise RuntimeError(f"vLLM's workers answered {got} to a push of {len(named)} "
                               f"tensors as version {version}")
        # Cached prefix blocks hold keys and values of the weights before (the policy's, and
        # the drafter's beside them): a prompt seen before would be served from them.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not drop its prefix cache after a weight push")

    def served_versions(self) -> list[dict[str, int | None]]:
        """Each vLLM worker's policy and drafter versions: what it serves now."""
        return self.llm.collective_rpc("fastdraft_versions")

    def digest(self, draft: bool) -> list[str]:
        return self.llm.collective_rpc("fastdraft_digest", args=(draft,))

    def fall_back_to_plain(self, reason: str) -> None:
        # vLLM cannot stop speculating between requests: it keeps the last good drafter (its
        # output is lossless either way; only the speed the fallback guards is lost).
        self.host.fall_back_to_plain(reason)
        print(f"rollout.backend=vllm: drafter fallback ({reason}); vLLM keeps speculating with "
              f"the last good drafter")

    def close(self) -> None:
        llm, self.__dict__["llm"] = self.__dict__.get("llm"), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    captures_hidden = False   # vLLM hands out no hidden states


class _Answer:
    """A request's answer as vLLM hands it out, step by step (RequestOutputKind.DELTA)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.spec: SpecStats | None = None

    def extend(self, delta: Any) -> int:
        new = list(delta.token_ids)
        self.tokens += new
        self.logprobs += [step[token].logprob for step, token in zip(delta.logprobs, new)]
        self.finish_reason = delta.finish_reason
        if delta.spec_decode_metrics is not None:   # on the last delta
            self.spec = spec_stats_of(delta.spec_decode_metrics)
        return len(new)

    def completion(self, index: int, prompt: list[int], host: RolloutEngine) -> Completion:
        bad = [i for i, lp in enumerate(self.logprobs) if not math.isfinite(lp)]
        if bad or len(self.logprobs) != len(self.tokens):
            # the gate must never compare against a value vLLM did not compute
            raise RuntimeError(f"vLLM returned a non-finite or missing logprob at answer "
                               f"position(s) {bad[:5]} of request {index} (of "
                               f"{len(self.tokens)} tokens, {len(self.logprobs)} logprobs)")
        reason = FinishReason.STOP if self.finish_reason == "stop" else FinishReason.LENGTH
        return Completion(index=index, prompt_token_ids=list(prompt), token_ids=self.tokens,
                          logprobs=self.logprobs, finish_reason=reason,
                          policy_version=host.policy_version,
                          drafter_version=host.drafter_version, spec=self.spec)

