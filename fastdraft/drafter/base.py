"""The drafter contract shared by EAGLE-1 and EAGLE-3, and the registry of drafter kinds.

A drafter borrows the policy's frozen token embedding (never copies it, never saves it) and by
default its lm_head too, owning only its trainable layers. A drafter trained elsewhere (SpecForge,
speculators: export/imports.py) brings an lm_head of its own, over its draft vocabulary in draft
order (`head_rows` rows); it is then trained and saved with the rest. One call of `step` maps
(features, next token) pairs to the next features and the draft logits, for any positions and
attention pattern (draft trees).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fastdraft.drafter.layout import LayerLayout
from fastdraft.errors import FastdraftError
from fastdraft.models import AttnMeta, CausalLM, HiddenStates, KVView, ModelConfig
from fastdraft.models.rope import RopeTable, RotaryEmbedding


class Drafter(nn.Module):
    kind: ClassVar[str]

    @classmethod
    def layer_layout(cls, target: ModelConfig) -> LayerLayout:
        """The switches of this kind's decoder layer for `target`: what every engine format
        that loads this kind for such a target can hold (see layout.py)."""
        raise NotImplementedError

    def __init__(self, cfg: ModelConfig, max_positions: int,
                 layout: LayerLayout | None = None, *, aux_layers: tuple[int, ...] | None = None,
                 head_rows: int | None = None) -> None:
        """cfg: the target policy's config (shapes, rope, vocabulary); layout: the layer's
        switches, by default this kind's for the target (a legacy checkpoint passes its own);
        aux_layers: the policy layers whose inputs the drafter reads (EAGLE-3; None: the kind's
        default); head_rows: rows of an lm_head of its own (None: the policy's is borrowed)."""
        super().__init__()
        if head_rows is not None and not 0 < head_rows <= cfg.vocab_size:
            raise FastdraftError(f"the drafter's own lm_head has {head_rows} rows, but the "
                                 f"policy's vocabulary has {cfg.vocab_size} tokens: a draft "
                                 "vocabulary is at most the policy's")
        self._aux_layers = None if aux_layers is None else tuple(int(i) for i in aux_layers)
        self.config = cfg
        self.layout = self.layer_layout(cfg) if layout is None else layout
        # What the drafter's decoder layer is built from: never the target's own switches.
        self.layer_config = self.layout.apply(cfg)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position_embeddings, max_positions)
        # Borrowed from the policy by attach(); kept out of state_dict and parameters().
        self._borrowed: dict[str, nn.Module] = {}
        # Optional draft vocabulary (target token ids, [Vd]): drafting scores only these tokens
        # (engine/spec/draft_head.py); saved with the checkpoint.
        self.draft_token_ids: torch.Tensor | None = None
        self.head = (None if head_rows is None
                     else nn.Linear(cfg.hidden_size, head_rows, bias=False))

    @property
    def options(self) -> dict:
        """What build_drafter needs besides kind, policy config and positions to rebuild this
        drafter's modules (a checkpoint records it: drafter/checkpoint.py)."""
        return {"layout": self.layout, "aux_layers": self._aux_layers,
                "head_rows": None if self.head is None else self.head.out_features}

    def attach(self, policy: CausalLM) -> Drafter:
        """Shares the policy's embedding and lm_head (frozen for the drafter)."""
        pc, dc = policy.config, self.config
        for field in ("hidden_size", "vocab_size"):
            if getattr(pc, field) != getattr(dc, field):
                raise FastdraftError(f"drafter {field}={getattr(dc, field)} does not match the "
                                     f"policy's {field}={getattr(pc, field)}: train or export a "
                                     "drafter for this policy")
        self._borrowed = {"embed_tokens": policy.model.embed_tokens, "lm_head": policy.lm_head}
        return self

    def detached(self) -> Drafter:
        """A copy of the trainable layers (and draft vocabulary) that borrows nothing yet:
        what travels to a trainer, which attaches it to its own copy of the policy head."""
        copy = build_drafter(self.kind, self.config, self.rope.cos.shape[0], **self.options)
        copy.load_state_dict(self.state_dict())
        copy.draft_token_ids = self.draft_token_ids
        return copy

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Policy layers whose inputs the drafter reads (EAGLE-3); () = final hidden only."""
        return ()

    # Detached: drafter gradients must never reach (or accumulate on) the policy's weights.
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self._borrowed_weight("embed_tokens"))

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the policy's vocabulary, or over the own head's rows (its draft
        vocabulary, in draft order)."""
        if self.head is not None:
            return self.head(h)
        return F.linear(h, self._borrowed_weight("lm_head"))

    def lm_head_weight(self) -> torch.Tensor:
        return self._borrowed["lm_head"].weight.detach()

    def head_probs(self, policy_probs: torch.Tensor) -> torch.Tensor:
        """The policy's next-token distribution [..., V] on the tokens `lm_head` scores: all of
        them, or an own head's draft vocabulary (not renormalised: mass outside it is mass the
        drafter can never propose, so CE against it is CE against p with q = 0 there, and
        sum(min(p, q)) stays the acceptance rate)."""
        if self.head is None or self.draft_token_ids is None:
            return policy_probs
        return policy_probs.index_select(-1, self.draft_token_ids.to(policy_probs.device))

    def _borrowed_weight(self, name: str) -> torch.Tensor:
        weight = self._borrowed[name].weight
        return weight.detach() if torch.is_grad_enabled() else weight

    def target_features(self, hidden: HiddenStates) -> torch.Tensor:
        """[B, T, H] features of the policy's own tokens, the drafter's input at those tokens."""
        raise NotImplementedError

    def step(self, features: torch.Tensor, input_ids: torch.Tensor,
             positions: torch.Tensor | RopeTable, kv: KVView | None = None,
             attn: AttnMeta | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, T, H] (of token t), input_ids [B, T] (token t + 1), positions [B, T]
        (of token t + 1) or their RopeTable -> (features predicted for token t + 1 [B, T, H],
        logits [B, T, V] for token t + 2)."""
        out = self.advance(features, input_ids, positions, kv, attn)
        return out, self.lm_head(self.head_input(out))

    def advance(self, features: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor | RopeTable, kv: KVView | None = None,
                attn: AttnMeta | None = None) -> torch.Tensor:
        """`step` without the logits: the engine computes them only where it uses them."""
        raise NotImplementedError

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads from the drafter's output features."""
        return out

    def rope_for(self, positions: torch.Tensor | RopeTable, dtype: torch.dtype) -> RopeTable:
        """A draft tree looks up every level's rotation at once and passes the table in."""
        return positions if isinstance(positions, RopeTable) else self.rope(positions, dtype)


DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(kind: str) -> Callable[[type[Drafter]], type[Drafter]]:
    def wrap(cls: type[Drafter]) -> type[Drafter]:
        cls.kind = kind
        DRAFTERS[kind] = cls
        return cls
    return wrap


def _drafter_class(kind: str) -> type[Drafter]:
    if kind not in DRAFTERS:
        raise FastdraftError(f"unknown drafter kind {kind!r}; choose one of {sorted(DRAFTERS)}")
    return DRAFTERS[kind]


def drafter_layer_config(kind: str, policy_config: ModelConfig) -> ModelConfig:
    """The config a `kind` drafter's decoder layer is built from for this policy: the policy's
    shapes with the kind's own switches (no QK-norm; biases only where the engines have them)."""
    return _drafter_class(kind).layer_layout(policy_config).apply(policy_config)


def build_drafter(kind: str, cfg: ModelConfig, max_positions: int,
                  layout: LayerLayout | None = None, *, aux_layers: tuple[int, ...] | None = None,
                  head_rows: int | None = None) -> Drafter:
    """A `kind` drafter for the policy whose config is `cfg`; its layer gets the kind's layout
    for that policy unless `layout` (a saved checkpoint's) is given; aux_layers and head_rows as
    Drafter takes them (a saved or imported checkpoint's)."""
    return _drafter_class(kind)(cfg, max_positions, layout, aux_layers=aux_layers,
                                head_rows=head_rows)
