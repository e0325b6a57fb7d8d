"""The one definition of "the distribution a token is sampled from", shared by target and draft.

Speculative sampling is lossless only if the target distribution p that verification checks
against is exactly the distribution plain sampling would draw from, and if the draft distribution
q the proposer drew from is the one verification divides by. Both therefore come from
`processed_probs`: softmax(filter_top_k_top_p(logits / T)), the same steps as `sampler.sample`.
"""

from __future__ import annotations

import torch

from fastdraft.engine.sampler import filter_top_k_top_p
from fastdraft.engine.sampling_params import SamplingParams


def _as_float(logits: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 -> fp32 (probabilities need the precision); fp64 stays fp64 (tests)."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] that plain sampling with `params` draws from.

    Greedy params give the one-hot argmax (ties: the first maximum, as torch.argmax).
    """
    logits = _as_float(logits)
    if params.is_greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scaled = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1:
        vocab = scaled.shape[-1]
        flat = scaled.reshape(-1, vocab)
        rows = flat.shape[0]
        top_k = min(params.top_k, vocab) if params.top_k > 0 else vocab
        scaled = filter_top_k_top_p(
            flat,
            torch.full((rows,), top_k, device=flat.device),
            torch.full((rows,), params.top_p, device=flat.device, dtype=flat.dtype),
        ).reshape(scaled.shape)
    return scaled.softmax(dim=-1)


def policy_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> log-softmax(logits / T) [..., V], T = 1 for greedy.

    What the engine reports per token: the policy's own log-probability, before top-k / top-p
    filtering (the same convention as `sampler.sample`), so RL importance ratios stay correct.
    """
    logits = _as_float(logits)
    temperature = 1.0 if params.is_greedy else params.temperature
    return (logits / temperature).log_softmax(dim=-1)


def conditioned_gumbel_keys(log_q: torch.Tensor, parent_key: torch.Tensor,
                            generator: torch.Generator | None = None,
                            noise: torch.Tensor | None = None) -> torch.Tensor:
    """Perturbed keys of the children of tree nodes, conditioned so that their max == parent key.

    log_q [..., V] (draft log-probs, -inf = excluded), parent_key [...] -> keys [..., V].
    This is the top-down Gumbel of Stochastic Beam Search (Kool et al., 2019): keys are
    Gumbel(parent_key + log q) conditioned on max = parent_key. Sorting the keys gives the
    children in the order of sampling without replacement from q (the is_sampled contract),
    and keys never increase along a path, so a global top-M of nodes by key is automatically a
    tree in which every node's kept children are a prefix of its draw order. A proposer that
    prunes a sampled tree by key must use these keys: with the naive cumulative key
    (parent key + log q + fresh Gumbel) the pruned tree is NOT lossless under verification.
    noise: Exp(1) samples shaped like log_q (drawn from `generator` when not given).
    """
    if noise is None:
        noise = torch.empty_like(log_q).exponential_(generator=generator)
    keys = parent_key.unsqueeze(-1) + log_q - noise.log()        # Gumbel(parent key + log q)
    return _condition(keys, keys.amax(dim=-1, keepdim=True), parent_key)


def conditioned_gumbel_topk(log_q: torch.Tensor, parent_key: torch.Tensor, k: int,
                            noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """conditioned_gumbel_keys(log_q, parent_key, noise=noise).topk(k), computed cheaply: the
    conditioning is increasing in the raw key, so the top-k of the raw keys are the same
    children in the same order, and only those k keys need conditioning.
    -> (indices, conditioned keys), both [..., k]."""
    keys = parent_key.unsqueeze(-1) + log_q - noise.log()
    top = keys.topk(k, dim=-1)
    return top.indices, _condition(top.values, top.values[..., :1], parent_key)


def _condition(keys: torch.Tensor, top: torch.Tensor, parent_key: torch.Tensor) -> torch.Tensor:
    """Raw perturbed keys [..., n] with their max `top` [..., 1] -> keys conditioned on
    max == parent_key [...]: -log(exp(-T) - exp(-Z) + exp(-keys)) (Kool et al. 2019),
    as -logaddexp(-T, log(exp(-keys) - exp(-Z))). Increasing in keys; the max maps exactly to T
    (its log term is -inf) and -inf stays -inf (its log term is +inf)."""
    log_gap = torch.log1p(-torch.exp(keys - top)) - keys      # log(exp(-keys) - exp(-Z))
    out = -torch.logaddexp(-parent_key.unsqueeze(-1), log_gap)
    # A row with no finite key (a -inf parent: top = -inf) gives NaN above; its keys are -inf.
    return out.masked_fill(torch.isneginf(keys), float("-inf"))
