"""Per-token statistics of the policy's sampling law, from the actor's own logits: what the
lossless gate (algo/gate.py) compares with the engine's rollout.

Two different distributions matter per position t (logits z_t, temperature T):
- the *policy* distribution softmax(z_t / T), unfiltered: its log-probability of the sampled
  token is what the engine reports (engine/sampler.py `sample`, spec/accept.py: "before top-k /
  top-p") and what the importance ratio needs;
- the *sampling* distribution p_t = softmax(filter_top_k_top_p(z_t / T)) that tokens are really
  drawn from (the engine's `SamplingTensors.scale_and_filter`, the same function here): the law
  statistic tests the sampled tokens against it.

The law statistic. For x_t ~ p_t, the surprise s_t = -log p_t(x_t) has conditional mean H_t (the
entropy of p_t) and conditional variance V_t = E_p[(log p)^2] - H_t^2. So sum_t (s_t - H_t) is a
martingale and z = sum_t (s_t - H_t) / sqrt(sum_t V_t) is ~N(0, 1) by the martingale CLT, however
the rows are batched or where answers stop. Why it catches a broken rejection sampler, which a
per-token |logprob diff| cannot: the engine reports log p of whichever token it emitted, and the
actor recomputes exactly that, so the diffs stay ~0 whatever law drew the tokens. But a verifier
that accepts draft tokens too often emits a share f of tokens from the drafter's q instead of p,
shifting the mean surprise per token by b = f * (E_q[-log p] - H(p)): negative for a drafter
sharper than the policy (its drafts sit on p's modes: the usual case), positive for a flat one.

What the gate judges is that per-token bias in nats, not z alone: b = mean_t (s_t - H_t) over the
N tokens, with standard error se = sqrt(sum_t V_t) / N (so z = b / se). z grows with sqrt(N) at
any fixed bias, so at millions of tokens a step even the tiny systematic bias that the engine's
and the actor's different rounding of the logits leaves (the engine samples from its own, a
little different, law) would exceed any fixed |z| limit; the gate instead fails a step only when
the bias is confidently beyond a per-token tolerance that the dtypes' rounding explains:
|b| - k * se > tolerance, k = law_z_threshold standard errors (equivalently |z| > k + tolerance /
se). Under a bias within the tolerance a false alarm is below P(|N(0, 1)| > k) (~2e-9 a step at
k = 6). With few tokens se is large, tolerance / se small, and the rule is |z| > k; with many it
sees any bias beyond tolerance + k * se: with a mean variance v ~ 1 nat^2 a token, k * se is
0.06 nats at 10^4 tokens, 0.006 at 10^6. It tests one moment of the law, not all of it: a bias
that leaves the mean surprise unchanged passes (the engine's chi-square tests, tests/engine/spec/,
cover the full law on small vocabularies). With few tokens the CLT is rough (one rare token can
weigh a lot), so the gate only judges the law from `law_min_tokens` tokens on.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fastdraft.engine.sampler import filter_top_k_top_p
from fastdraft.errors import FastdraftError

# fp32 bytes of one chunk of the [*, V] work tensors: the full [B, T, V] logits are never copied.
CHUNK_BYTES = 64 * 2**20


class TokenStats(NamedTuple):
    """[B, T] per token (0 where not computed). logprob: log softmax(z / T) of the target, the
    policy's own (unfiltered: what the engine reports). sample_logprob: log p of the target
    under the sampling distribution p (top-k / top-p applied; -inf where the target is outside
    it; the same as logprob when nothing filters). entropy: H(p); variance: Var_p(-log p).
    Only logprob given (entropy None): the law statistic is skipped."""

    logprob: torch.Tensor
    sample_logprob: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    variance: torch.Tensor | None = None


class LawStatistic(NamedTuple):
    """z: the standardised sum of (surprise - entropy); tokens: how many it sums;
    surprise / entropy: their means per token (nats); outside: tokens the actor's own filter
    excludes (rounding at the nucleus' edge), left out of z; bias: the mean (surprise -
    entropy) per token (nats), se: its standard error sqrt(sum Var) / tokens (z = bias / se;
    both 0 without tokens)."""

    z: float
    tokens: int
    surprise: float
    entropy: float
    outside: int
    bias: float = 0.0
    se: float = 0.0


@torch.no_grad()
def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                top_p: float = 1.0, top_k: int = -1, mask: torch.Tensor | None = None
                ) -> TokenStats:
    """logits [B, T, V] (any float dtype, any strides; column t scores targets[:, t]),
    targets [B, T] long -> TokenStats of [B, T] fp32 tensors. mask [B, T] bool: compute only
    there (0 elsewhere); None: everywhere. Works in chunks of positions, so at most a chunk of
    fp32 [*, V] temporaries exists at a time, never a second [B, T, V] copy; keeps no graph."""
    if temperature <= 0:
        raise FastdraftError(f"temperature={temperature}: the law of sampled tokens needs T > 0")
    batch, width, vocab = logits.shape
    if tuple(targets.shape) != (batch, width):
        raise FastdraftError(f"targets has shape {tuple(targets.shape)}: expected {(batch, width)}")
    where = (torch.ones(batch, width, dtype=torch.bool) if mask is None else mask.cpu())
    index = where.nonzero()                                                  # [M, 2]
    out = torch.zeros(4, batch, width)
    chunk = max(1, CHUNK_BYTES // (4 * vocab))
    dev = logits.device
    for part in index.split(chunk):
        rows, cols = part[:, 0].to(dev), part[:, 1].to(dev)
        scaled = logits[rows, cols].float() / temperature                    # [n, V]
        target = targets.to(dev)[rows, cols].unsqueeze(-1)
        out[:, part[:, 0], part[:, 1]] = scaled_stats(scaled, target, top_p, top_k).cpu()
    return TokenStats(*out.unbind(0))


@torch.no_grad()
def scaled_stats(scaled: torch.Tensor, target: torch.Tensor, top_p: float = 1.0,
                 top_k: int = -1) -> torch.Tensor:
    """fp32 logits / T [n, V], target [n, 1] -> [4, n]: the
    TokenStats fields (logprob, sample_logprob, entropy, variance) of these positions."""
    n, vocab = scaled.shape
    logprob = scaled.gather(-1, target).squeeze(-1) - scaled.logsumexp(-1)
    k = vocab if top_k < 0 else min(top_k, vocab)
    if k < vocab or top_p < 1:
        scaled = filter_top_k_top_p(scaled, torch.full((n,), k, device=scaled.device),
                                    torch.full((n,), top_p, device=scaled.device))
    return torch.stack([logprob, *_law_of(scaled.log_softmax(-1), target)])


def _law_of(log_p: torch.Tensor, target: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log p [n, V] (-inf off the support), target [n, 1] -> (log p of the target, H, Var)."""
    p = log_p.exp()
    on = p > 0                                   # 0 * -inf would be NaN off the support
    entropy = -torch.where(on, p * log_p, 0.0).sum(-1)
    # two-pass variance: E_p[(log p + H)^2], no cancellation between E[(log p)^2] and H^2
    centred = torch.where(on, log_p + entropy.unsqueeze(-1), 0.0)
    variance = (p * centred.square()).sum(-1)
    return log_p.gather(-1, target).squeeze(-1), entropy, variance


def law_statistic(stats: TokenStats, mask: torch.Tensor) -> LawStatistic:
    """The law statistic (module docstring: z, the per-token bias and its standard error) over
    the tokens of mask [B, T] with finite statistics; needs stats.entropy (a logprob-only
    TokenStats has no law)."""
    if stats.entropy is None or stats.variance is None or stats.sample_logprob is None:
        raise FastdraftError("the law statistic needs TokenStats with sample_logprob, entropy and "
                             "variance (token_stats computes them)")
    mask = mask.bool() & torch.isfinite(stats.entropy) & torch.isfinite(stats.variance)
    inside = mask & torch.isfinite(stats.sample_logprob)
    surprise = -stats.sample_logprob[inside].double()
    entropy = stats.entropy[inside].double()
    total_var = float(stats.variance[inside].double().sum())
    excess = float((surprise - entropy).sum())
    tokens = int(inside.sum())
    z = excess / math.sqrt(total_var) if total_var > 0 else 0.0
    return LawStatistic(z=z, tokens=tokens,
                        surprise=float(surprise.mean()) if tokens else 0.0,
                        entropy=float(entropy.mean()) if tokens else 0.0,
                        outside=int((mask & ~inside).sum()),
                        bias=excess / tokens if tokens else 0.0,
                        se=math.sqrt(total_var) / tokens if tokens else 0.0)
