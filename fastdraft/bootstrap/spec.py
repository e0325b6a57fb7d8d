"""What the bootstrap trains: ``BootstrapSpec`` (the policy's architecture, size and training
schedule; its digest is the cache key) and the named specs a recipe picks with
``model.bootstrap``.

``tiny``: the Qwen2 policy of the CPU recipe (``recipes/tiny-grpo.yaml``). ``tiny-qwen3``: the
policy of the miniature of the real recipes (``recipes/tiny-qwen3-eagle3.yaml``): a Qwen3 (QK-norm,
no qkv bias) with head_dim 64 as real models have, which vLLM's CPU attention accepts (it refuses
``tiny``'s head_dim 16), and 8 layers so that EAGLE-3's aux layers [2, L // 2, L - 3] are distinct.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from fastdraft.errors import FastdraftError
from fastdraft.utils.registry import Registry

#: Bumped whenever encoding or training changes meaning, so stale caches are not reused.
#: 2: deterministic training (pinned threads, forked init RNG), weights digest in the report.
#: 3: restarts from a fresh init when an attempt stays on the learning plateau.
FORMAT_VERSION = 3
#: Architectures a bootstrap policy can have (the model_type written to its config.json).
ARCHITECTURES = ("qwen2", "qwen3")


@dataclass(frozen=True, kw_only=True, slots=True)
class BootstrapSpec:
    """Architecture, size and training schedule of a bootstrap policy (defaults: ``tiny``).

    ``architecture``: ``qwen2`` or ``qwen3`` (the family's switches: Qwen2 has a qkv bias,
    Qwen3 QK-norm and no bias). ``head_dim``: None = ``hidden_size // num_heads``; set, the q
    projection may be wider than ``hidden_size`` (``num_heads * head_dim``), as in Qwen3.
    The defaults train in ~100 s on 2 CPU cores (it was 1000 steps x 64 problems, ~300 s) and
    land greedy held-out accuracy at ~30%: ~50% on 3-5 term problems, chance on long ones, so RL
    has a signal and room to improve; tests pass a tiny spec.
    ``bucket_batches``: batches drawn at once and sorted by length before being split, so a batch
    pads to similar lengths instead of to the one rare long problem it happens to hold.
    ``thin_above_tokens``, ``thin_keep``: problems longer than this (prompt + solution + EOS;
    22 = modsum's 5 terms) are kept with probability ``thin_keep``. Accuracy is learnt on the
    short problems first, while the long ones cost most of the compute (per token, plus padding
    and quadratic attention); a quarter of them still teach the answer format at every length,
    so greedy answer lengths keep the task's long tail.
    ``num_threads``: torch intra-op threads for training and evaluation, whatever the machine
    has: CPU kernels may split reductions by thread count, so the count is pinned, recorded and
    part of the digest (``determinism.py``).
    ``restart_after``, ``restart_below``, ``max_attempts``: modsum is learnt through a plateau
    (loss ~0.72, dev exact match ~1%) that an initialisation leaves after 300-650 steps, or
    not within 1600: seed 0 escaped at step 650 on one machine and never on another (AMD EPYC,
    AVX2: 1 or 2 threads, three learning rates, up to 1600 steps), where seed 1 escaped by 425
    (dev 4% at 300, 16% at 400) and seed 1 at 2 threads was at 9% by 500. Which init escapes
    depends on the CPU's arithmetic, so an attempt whose dev exact match is still below
    ``restart_below`` at step ``restart_after`` is abandoned (the stuck ones measured 0-1.6%
    there) and training starts again from a fresh init and data stream (attempt k uses
    seed + k), up to ``max_attempts``; the last attempt trains its full ``steps``.
    """

    task: str = "modsum"
    architecture: str = "qwen2"
    hidden_size: int = 128
    head_dim: int | None = None
    intermediate_size: int = 256
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    steps: int = 1000
    batch_size: int = 48
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bucket_batches: int = 32
    thin_above_tokens: int = 22
    thin_keep: float = 0.25
    stop_at_short_accuracy: float = 0.35
    restart_after: int = 500
    restart_below: float = 0.04
    max_attempts: int = 3
    check_every: int = 25
    num_dev: int = 128
    num_threads: int = 2
    num_heldout: int = 512
    eval_batch_size: int = 128
    max_new_tokens: int = 160

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "steps", "batch_size", "bucket_batches", "check_every", "num_dev",
                     "num_threads", "num_heldout", "eval_batch_size", "max_new_tokens",
                     "restart_after", "max_attempts"):
            if getattr(self, name) < 1:
                raise FastdraftError(f"BootstrapSpec.{name} must be >= 1, got "
                                     f"{getattr(self, name)}")
        if self.architecture not in ARCHITECTURES:
            raise FastdraftError(f"BootstrapSpec.architecture={self.architecture!r}: choose one of "
                                 f"{list(ARCHITECTURES)}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise FastdraftError(f"hidden_size={self.hidden_size} is not a multiple of "
                                 f"num_heads={self.num_heads}: change one of them, or set head_dim")
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise FastdraftError(f"head_dim={self.head_dim} must be an even number >= 2 (rotary "
                                 "embeddings rotate pairs of channels)")
        if self.num_heads % self.num_kv_heads:
            raise FastdraftError(f"num_heads={self.num_heads} is not a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}: change one of them")
        if not 0 <= self.warmup_steps < self.steps:
            raise FastdraftError(f"warmup_steps={self.warmup_steps} must be in [0, "
                                 f"steps={self.steps})")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise FastdraftError("lr must be > 0 and min_lr_ratio in [0, 1]")
        if not 0 <= self.stop_at_short_accuracy <= 1:
            raise FastdraftError(f"stop_at_short_accuracy={self.stop_at_short_accuracy} must be in "
                                 "[0, 1] (0 trains all steps)")
        if not 0 <= self.restart_below <= 1:
            raise FastdraftError(f"restart_below={self.restart_below} must be in [0, 1] (0 never "
                                 "restarts)")
        if not 0 < self.thin_keep <= 1:
            raise FastdraftError(f"thin_keep={self.thin_keep} must be in (0, 1] (1 keeps every "
                                 "long problem)")

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def digest(self, seed: int) -> str:
        """Short hash of spec + seed + format version: the cache key of a trained policy.

        ``architecture`` and ``head_dim`` came after policies were cached: at the values every
        earlier spec implied (qwen2, hidden_size // num_heads) they are left out of the hash, so
        those caches (the ``tiny`` policy's) keep their key; any other value is hashed."""
        fields = asdict(self)
        if self.architecture == "qwen2":
            del fields["architecture"]
        if self.hidden_size % self.num_heads == 0 and (
                self.attention_head_dim == self.hidden_size // self.num_heads):
            del fields["head_dim"]
        blob = json.dumps({"spec": fields, "seed": seed, "format": FORMAT_VERSION},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


#: Named specs: a recipe's ``model.bootstrap`` and ``fastdraft bootstrap --spec`` pick one.
BOOTSTRAP_SPECS: Registry[BootstrapSpec] = Registry("bootstrap spec")
DEFAULT_SPEC = "tiny"
BOOTSTRAP_SPECS.register(DEFAULT_SPEC)(BootstrapSpec())

# The miniature's policy is trained to the answer format only (300 steps, one attempt: greedy
# accuracy ~9%, chance, at every length; 134 s on 2 cores). The plateau escape the ``tiny`` spec
# pays for (1000-2000 steps over up to 3 attempts, ~550 s here) bought this architecture no
# accuracy (10.9% after 2025 steps, 3 attempts), and the miniature exercises the real path
# (answer lengths, group reward variance from the sampled answer digit, online drafter), not
# learning the task.
BOOTSTRAP_SPECS.register("tiny-qwen3")(BootstrapSpec(
    architecture="qwen3", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
    intermediate_size=256, num_layers=8, steps=300, max_attempts=1))


def get_spec(name: str) -> BootstrapSpec:
    """The named spec; an unknown name raises a FastdraftError listing the known ones."""
    return BOOTSTRAP_SPECS.get(name)
