"""The `algorithm` section: advantage, policy loss and their options, the lossless gate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from fastdraft.config.sections.common import Range, check_ranges
from fastdraft.config.sections.common import require as _require
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, kw_only=True, slots=True)
class GateSection:
    """algorithm.gate: the lossless gate (algo/gate.py), checked every step before any weight
    moves. Limits on |actor - engine| logprob per sampled token: mean_tolerance (their mean),
    quantile_tolerance (their `quantile`, e.g. the 0.99 one), max_tolerance (a gross token) and
    max_share (the share of tokens that may exceed it: 0 in fp32 and fp16, where one gross token
    fails; 1e-3 in bf16, whose rounding reaches nats at rare tokens); None: from the coarser of
    model.dtype and actor.compute_dtype (algo/gate.py DTYPE_TOLERANCE). The law check (the
    sampled tokens against the policy's law) bounds the per-token bias b = mean(-log p(x) - H)
    in nats: the rollout counts as not sampled from the policy when |b| - law_z_threshold * se
    > law_bias_tolerance, se = sqrt(sum Var) / tokens (equivalently |z| > law_z_threshold +
    law_bias_tolerance / se: at few tokens |z| > 6, at millions a bias confidently beyond the
    tolerance). law_z_threshold: the standard errors the bias' interval spans (6: a false alarm
    below ~2e-9 a step; None: no law check); law_bias_tolerance: nats a token (None: from the
    coarser dtype, algo/gate.py LAW_BIAS_TOLERANCE: fp32 1e-3, fp16 0.01, bf16 0.02); judged
    from law_min_tokens sampled tokens on."""

    SECTION: ClassVar[str] = "algorithm.gate"

    mean_tolerance: Annotated[float | None, Range(gt=0, note="from the dtypes")] = None
    quantile: Annotated[float, Range(ge=0.5, lt=1, note="a high quantile, e.g. 0.99; the max "
                                     "has its own limit")] = 0.99
    quantile_tolerance: Annotated[float | None, Range(gt=0, note="from the dtypes")] = None
    max_tolerance: Annotated[float | None, Range(gt=0, note="from the dtypes")] = None
    max_share: Annotated[float | None, Range(ge=0, lt=1, note="from the dtypes")] = None
    law_z_threshold: Annotated[float | None, Range(gt=0, note="no law check")] = 6.0
    law_bias_tolerance: Annotated[float | None, Range(gt=0, note="from the dtypes")] = None
    law_min_tokens: Annotated[int, Range(ge=1)] = 128

    def __post_init__(self) -> None:
        check_ranges(self)


_OPTION_OWNERS = {"scale_std": "advantage", "clip_high": "loss"}   # field -> its registry


def _registries() -> dict[str, tuple[Callable[[], list[str]], Callable[[str], dict]]]:
    """What the registered estimators and losses take (their functions' keyword options): a
    value set for one that does not take it would do nothing, so it is an error. The
    registries (algo/, torch code) are looked up when a config is checked, not imported with
    this module: users register their own there before building a config."""
    from fastdraft.algo.advantages import advantage_defaults, available_advantages
    from fastdraft.algo.policy_loss import available_policy_losses, policy_loss_defaults
    return {"advantage": (available_advantages, advantage_defaults),
            "loss": (available_policy_losses, policy_loss_defaults)}


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    """advantage / loss: registered names (fastdraft/algo/advantages.py: grpo, dr_grpo, rloo;
    policy_loss.py: grpo, dapo). Options, each an error where it would do nothing:
    scale_std (advantage grpo only; None: true): divide by the group's std. false removes only
    the division; Dr. GRPO is `advantage: dr_grpo`, which also sets the length-unbiased
    aggregation (seq-mean-token-sum-norm over rollout.max_new_tokens).
    clip_eps: the clip range (grpo: symmetric; dapo: the lower one). clip_high (loss dapo only;
    None: 0.28): DAPO's upper clip. kl_coef: k3 KL to the frozen initial policy.
    aggregation (token-mean | seq-mean-token-mean | seq-mean-token-sum-norm; None: the
    advantage's preset, else the loss's own default). skip_zero_variance drops groups whose
    rewards are all equal (DAPO); resample_rounds (with it): up to this many more rollouts of
    fresh prompts a step refill the dropped groups (DAPO's dynamic sampling). overlong_filter:
    an answer cut at rollout.max_new_tokens carries no gradient; overlong_buffer (0: off):
    DAPO's soft overlong punishment over the last this many tokens of the budget
    (algo/overlong.py). gate: the lossless gate's limits (GateSection)."""

    SECTION: ClassVar[str] = "algorithm"

    num_steps: Annotated[int, Range(ge=1)] = 20
    advantage: str = "grpo"
    scale_std: bool | None = None       # None: the estimator's default
    loss: str = "grpo"
    clip_eps: Annotated[float, Range(gt=0, lt=1)] = 0.2
    clip_high: Annotated[float | None, Range(ge=0, note="the loss's default")] = None
    kl_coef: Annotated[float, Range(ge=0, note="0: no KL term")] = 0.0
    aggregation: str | None = None      # None: the advantage's preset or the loss's default
    skip_zero_variance: bool = False
    resample_rounds: Annotated[int, Range(ge=0, note="0: no resampling")] = 0
    overlong_filter: bool = False
    overlong_buffer: Annotated[int, Range(ge=0, note="0: no soft overlong punishment")] = 0
    gate: GateSection = field(default_factory=GateSection)

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(not self.resample_rounds or self.skip_zero_variance, "algorithm."
                 "resample_rounds refills the groups skip_zero_variance drops: set "
                 "algorithm.skip_zero_variance=true, or resample_rounds=0")
        from fastdraft.algo.advantages import advantage_aggregation
        from fastdraft.algo.policy_loss import available_aggregations
        registries = _registries()
        taken = {kind: _options(registries[kind][1], kind, getattr(self, kind))
                 for kind in registries}
        for name, kind in _OPTION_OWNERS.items():
            if getattr(self, name) is not None and name not in taken[kind]:
                names, defaults = registries[kind]
                takers = [n for n in names() if name in defaults(n)]
                raise FastdraftError(
                    f"algorithm.{name} does nothing with algorithm.{kind}: {getattr(self, kind)} "
                    f"(only {kind} {' / '.join(takers) or '(none)'} takes it): delete it, or "
                    f"choose such a {kind}"
                    + ("; Dr. GRPO is advantage: dr_grpo" if name == "scale_std" else ""))
        _require(self.aggregation is None or self.aggregation in available_aggregations(),
                 f"algorithm.aggregation must be one of {available_aggregations()} or null, "
                 f"got {self.aggregation!r}")
        preset = advantage_aggregation(self.advantage)
        _require(preset is None or self.aggregation in (None, preset),
                 f"algorithm.advantage: {self.advantage} is defined with aggregation {preset}; "
                 f"algorithm.aggregation: {self.aggregation} contradicts it: delete "
                 "algorithm.aggregation, or choose another advantage")


def _options(defaults: Callable[[str], dict], kind: str, name: str) -> dict[str, Any]:
    """The keyword options (with defaults) of the registered `kind` called `name`."""
    try:
        return defaults(name)
    except ValueError as err:
        raise FastdraftError(f"algorithm.{kind}: {err}") from None


