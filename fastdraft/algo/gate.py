"""The lossless gate: every RL step, before any weight moves, the actor's view of the rollout is
compared with the engine's. Speculation must never change what is learned, so a difference that
the dtypes' rounding does not explain stops the run (`LosslessGateError`).

Two checks, each blind to what the other sees:
- Per-token logprobs (engine's reported log p vs the actor's recomputed one, |diff| per token):
  catches a wrong weight push, a stale or misplaced KV cache, wrong positions. Robust statistics,
  because the engine's cached, packed forward and the actor's plain one round differently: the
  mean and a high quantile of |diff| have tolerances (a systematic shift moves them; a handful
  of rounding outliers among millions of bf16 tokens does not), and a limit on the tokens beyond
  a max catches a break confined to a few tokens: in fp32 and fp16 one such token fails, in bf16
  a small share of them is rounding (below).
- The law statistic (algo/token_stats.py): catches a rollout sampled from the wrong law, e.g. a
  rejection sampler that accepts drafts too often, which per-token diffs cannot see (the actor
  recomputes exactly the log p of whatever token the engine emitted). It judges the per-token
  bias b = mean(surprise - entropy) in nats, with a confidence interval of law_z_threshold (k)
  standard errors se = sqrt(sum Var) / N: the step fails when |b| - k * se > the bias tolerance
  (equivalently |z| > k + tolerance / se). A fixed |z| limit alone would grow strict with the
  step's token count (z = b / se ~ b * sqrt(N)) until the rounding bias between the engine's and
  the actor's forwards failed it; so a small step is judged as by |z| > k, a large one by its
  bias in nats.

Tolerances follow the dtype the logprobs are computed in on both sides: the engine serves
model.dtype, the actor computes in actor.compute_dtype, and the coarser of the two rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdraft.algo.token_stats import TokenStats, law_statistic
from fastdraft.config.sections import GateSection
from fastdraft.errors import FastdraftError

# (mean, quantile, max, max_share) of |actor - engine| per token that rounding explains, by
# the coarser dtype; max_share: the share of tokens allowed beyond max. fp32: both forwards agree
# to ~1e-5. fp16 (10-bit mantissa): the miniature policy's fp16 forward is within 0.63 nats of
# its fp32 one on every token. bf16 (8-bit mantissa: a logit of 30 rounds by ~0.1): typical
# tokens differ by ~1e-2, but a policy that RL has sharpened amplifies rounding at a few tokens
# into nats: the miniature's step-8/9 policies, the same weights and code in bf16 and fp32,
# differ by more than 4 nats at 3-4 of 11234 sampled tokens (max 8.2), each alone (its
# neighbours agree), and vLLM's bf16 forward at 2 other ones (docs/vllm-backend.md). No per-token
# limit separates that from a break in bf16; a share of them does (a wrong tensor, position or
# cache moves most of a sequence's tokens, which the mean and the quantile see).
DTYPE_TOLERANCE = {"float32": (1e-3, 1e-2, 0.1, 0.0), "float16": (0.02, 0.2, 2.0, 0.0),
                   "bfloat16": (0.05, 0.5, 4.0, 1e-3)}
# The law check's tolerance on the per-token bias b = mean(-log p(x) - H(p)) (nats a token), by
# the coarser dtype. The engine samples from its own forward's law, which rounding puts a little
# off the actor's, so b is not 0 but a systematic first-order term in the logit difference; in
# bf16 it is ~0.005 nats a token, which must pass: 0.02 leaves a 4x margin. fp16's 10-bit
# mantissa rounds 4x finer (a bias ~0.001): 0.01; fp32's rounding (~1e-6 a logit) biases b by far
# less than 1e-3. A wrong sampler that emits a share f of tokens from a sharper (or flatter)
# drafter shifts b by f * (E_q[-log p] - H(p)), typically >= 0.05 nats a token, beyond every one
# of these by 2.5x or more: at a real step's millions of tokens (k * se ~ 0.003) it fails as
# surely as at 10^4 (k * se ~ 0.06 with ~1 nat^2 of variance a token: then |b| must pass 0.08).
LAW_BIAS_TOLERANCE = {"float32": 1e-3, "float16": 0.01, "bfloat16": 0.02}
COARSENESS = ("float32", "float16", "bfloat16")


class LosslessGateError(FastdraftError):
    """The engine's rollout is not the policy's: a speculation or weight-push bug. (A
    FastdraftError, so the CLI stops with its message rather than a traceback.)"""


@dataclass(frozen=True, kw_only=True, slots=True)
class GateTolerance:
    """Resolved limits of the gate. mean / quantile_diff / max: of |actor - engine| per token;
    quantile: which quantile (0.99: p99); max_share: the share of tokens that may lie beyond
    max (0: none); law_z: k, the standard errors of the law's per-token bias that its
    confidence interval spans (None: no law check); law_bias: the tolerance on that bias, nats a
    token: the law fails when |bias| - k * se > law_bias (0: when |z| > k); law_min_tokens: the
    law is judged only from this many tokens on."""

    mean: float
    quantile: float
    quantile_diff: float
    max: float
    max_share: float = 0.0
    law_z: float | None = 6.0
    law_bias: float = 0.0
    law_min_tokens: int = 128

    @classmethod
    def for_dtypes(cls, serve_dtype: str, compute_dtype: str,
                   section: GateSection | None = None) -> GateTolerance:
        """The engine's model.dtype and the actor's actor.compute_dtype (the coarser rules);
        the recipe's algorithm.gate values, where set, override."""
        for name in (serve_dtype, compute_dtype):
            if name not in DTYPE_TOLERANCE:
                raise FastdraftError(f"no gate tolerance for dtype {name!r}: use one of "
                                     f"{sorted(DTYPE_TOLERANCE)}")
        coarser = max(serve_dtype, compute_dtype, key=COARSENESS.index)
        mean, quantile_diff, worst, share = DTYPE_TOLERANCE[coarser]
        s = section or GateSection()
        return cls(mean=_pick(s.mean_tolerance, mean), quantile=s.quantile,
                   quantile_diff=_pick(s.quantile_tolerance, quantile_diff),
                   max=_pick(s.max_tolerance, worst), max_share=_pick(s.max_share, share),
                   law_z=s.law_z_threshold,
                   law_bias=_pick(s.law_bias_tolerance, LAW_BIAS_TOLERANCE[coarser]),
                   law_min_tokens=s.law_min_tokens)


def _pick(value: float | None, default: float) -> float:
    return default if value is None else value


def check_gate(actor: TokenStats, engine_logprobs: torch.Tensor, mask: torch.Tensor,
               tolerance: GateTolerance) -> dict[str, float]:
    """actor: TokenStats [B, T] from the actor's forward; engine_logprobs [B, T] the engine's
    reported logprobs; mask [B, T] bool, the sampled tokens -> metrics (rollout/logprob_diff_
    mean, _p99 (the configured quantile), _max; rollout/law_z, law_bias (nats a token) and
    law_bias_ci (its interval's half-width, k standard errors) when the actor gave entropies).
    Raises LosslessGateError naming the worst token when a limit is passed.

    A sequence with a non-finite logprob (either side) is left out and counted
    (rollout/gate_nonfinite_sequences): the objective skips it too, so it teaches nothing. Only
    a batch in which no sequence is finite fails for it (corrupt weights or rollout)."""
    mask = mask.bool()
    actor_lp, engine_lp = actor.logprob.float().cpu(), engine_logprobs.float().cpu()
    mask = mask.cpu()
    finite = torch.isfinite(actor_lp) & torch.isfinite(engine_lp)
    has_tokens = mask.any(dim=1)
    bad_rows = has_tokens & ~(finite | ~mask).all(dim=1)
    if bool(has_tokens.any()) and bool(bad_rows[has_tokens].all()):
        raise LosslessGateError(
            "every sequence has a non-finite logprob (actor or engine): the policy's weights or "
            "the rollout are corrupt")
    keep = mask & ~bad_rows.unsqueeze(1)
    diff = torch.where(keep, (actor_lp - engine_lp).abs(), 0.0)
    values = diff[keep]
    count = values.numel()
    q_name = f"rollout/logprob_diff_p{_percent(tolerance.quantile)}"
    beyond = int((values > tolerance.max).sum())
    metrics = {"rollout/logprob_diff_mean": float(values.mean()) if count else 0.0,
               q_name: _quantile(values, tolerance.quantile),
               "rollout/logprob_diff_max": float(values.max()) if count else 0.0,
               "rollout/logprob_diff_beyond_max": float(beyond),
               "rollout/gate_nonfinite_sequences": float(bad_rows.sum())}
    if beyond > tolerance.max_share * count:
        allowed = (f"at most a share of {tolerance.max_share:g} may (the dtype's rounding "
                   "outliers)" if tolerance.max_share else "none may")
        raise LosslessGateError(_diff_message(
            diff, mask, actor_lp, engine_lp, "its largest per-token |logprob diff|",
            metrics["rollout/logprob_diff_max"], tolerance.max, count,
            f"{beyond} of them exceed {tolerance.max:g} nats, {allowed}"))
    for name, limit, what in (
            ("rollout/logprob_diff_mean", tolerance.mean, "the mean per-token |logprob diff|"),
            (q_name, tolerance.quantile_diff,
             f"the {tolerance.quantile:g} quantile of the |logprob diff|")):
        if metrics[name] > limit:
            raise LosslessGateError(_diff_message(diff, mask, actor_lp, engine_lp, what,
                                                  metrics[name], limit, count))
    if actor.entropy is not None and tolerance.law_z is not None:
        law = law_statistic(actor, keep)
        half_width = tolerance.law_z * law.se
        metrics.update({"rollout/law_z": law.z, "rollout/law_bias": law.bias,
                        "rollout/law_bias_ci": half_width,
                        "rollout/law_tokens": float(law.tokens),
                        "rollout/law_outside_filter": float(law.outside)})
        if (law.tokens >= tolerance.law_min_tokens
                and abs(law.bias) - half_width > tolerance.law_bias):
            raise LosslessGateError(
                f"lossless gate: the sampled tokens are not drawn from the policy's law: "
                f"z = {law.z:.1f} over {law.tokens} tokens, a bias of {law.bias:+.4f} "
                f"+- {half_width:.4f} nats a token ({tolerance.law_z:g} standard errors), "
                f"beyond the tolerance of {tolerance.law_bias:g} nats a token that the dtypes' "
                f"rounding explains: mean "
                f"surprise -log p = {law.surprise:.4f} vs the policy's entropy "
                f"{law.entropy:.4f} nats a token ({'sharper' if law.bias < 0 else 'flatter'} "
                f"than the policy), while the per-token logprobs agree. Check the speculative "
                f"path's rejection sampling (engine/spec/accept.py) and the drafter's q passed "
                f"to it (rollout.spec.method=none drafter.online.enabled=false isolates it); "
                f"raise algorithm.gate.law_bias_tolerance only if the dtypes' rounding explains "
                f"the bias")
    return metrics


def _percent(quantile: float) -> str:
    text = f"{quantile * 100:g}"
    return text.replace(".", "_")


def _quantile(values: torch.Tensor, quantile: float) -> float:
    """The nearest-rank quantile (kthvalue: no size limit, unlike torch.quantile)."""
    if not values.numel():
        return 0.0
    k = min(values.numel(), max(1, math.ceil(quantile * values.numel())))
    return float(values.kthvalue(k).values)


def _diff_message(diff: torch.Tensor, mask: torch.Tensor, actor: torch.Tensor,
                  engine: torch.Tensor, what: str, value: float, limit: float, count: int,
                  beyond: str = "") -> str:
    row, col = divmod(int(diff.argmax()), mask.shape[1])
    answer_pos = int(mask[row, :col].sum())        # the token's index within its answer
    return (f"lossless gate: {what} is {value:.3g} (> {limit:g}) over {count} tokens"
            f"{'; ' + beyond if beyond else ''}; "
            f"the worst token, sample {row}'s answer token {answer_pos} of "
            f"{int(mask[row].sum())} (column {col}): "
            f"the engine's logprob {float(engine[row, col]):.4f} differs from the actor's "
            f"{float(actor[row, col]):.4f} by {float(diff[row, col]):.3g}: the rollout was not "
            "sampled from the policy being trained. Check the weight push "
            "(engine.load_weights) and the speculative path (rollout.spec.method=none "
            "drafter.online.enabled=false isolates it); raise algorithm.gate tolerances only "
            "if the dtypes' rounding explains it")
