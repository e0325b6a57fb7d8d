"""EAGLE proposer: EAGLE-2 style dynamic draft trees from a trained drafter, batched over requests
and run inside the step (captured stages, no host sync).

Per level, the `topk` best frontier nodes of every request run through the drafter in ONE forward
(tree attention over the drafter's own slot cache, the nodes' cells right after each row's
context), each proposes `topk` children, and the best `tokens_to_verify` nodes are kept. Greedy
requests rank by cumulative draft log-probability and verify children as point masses. Sampling
requests draw children WITHOUT replacement from q with the top-down Gumbel of Stochastic Beam
Search (keys conditioned on their parent's key, so keys never increase along a path): the
best-first top-M is then a tree whose kept children are always a prefix of their draw order,
which recursive rejection sampling needs to stay lossless. (Naive cumulative perturbed keys are
NOT lossless after pruning; tests/engine/spec shows the bias.) A sampled node draws from q
restricted to its `sample_top_m` most likely tokens and renormalised: any q is lossless as long
as verification divides by the very q drawn from, and this one needs noise for m tokens, not V.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.drafter.base import Drafter
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.prefix_share import SharedPrefill
from fastdraft.engine.request import Request
from fastdraft.engine.rng import Stream, draft_counter, uniform_keyed
from fastdraft.engine.sampler import SamplingTensors
from fastdraft.engine.scheduler import SlotMove
from fastdraft.engine.slot_state import move_slots
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.draft_head import DraftHead
from fastdraft.engine.spec.draft_layout import DraftLayout, select_tree
from fastdraft.engine.spec.probs import conditioned_gumbel_topk
from fastdraft.engine.spec.proposer import Proposer, register_proposer
from fastdraft.engine.step_io import SamplingMode, StepIO
from fastdraft.errors import FastdraftError
from fastdraft.models import AttnMeta, CausalLM, HiddenStates, KVView
from fastdraft.models.attn_meta import TreeMask, causal_pairs_mask
from fastdraft.models.packing import pack_for_inference
from fastdraft.models.rope import RopeTable


class EagleProposer(Proposer):
    source_id = 0
    drafts_on_device = True

    def __init__(self, *, drafter: Drafter, num_slots: int, envelope: Envelope,
                 compile: bool = False, draft_token_ids: torch.Tensor | None = None,
                 sample_top_m: int = 64, **_: object) -> None:
        self.drafter = pack_for_inference(drafter)  # in place: published weights still load
        self.advance = (torch.compile(drafter.advance, dynamic=True) if compile
                        else drafter.advance)
        self.head = DraftHead(drafter, draft_token_ids if draft_token_ids is not None
                              else drafter.draft_token_ids)
        cfg = drafter.config
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.envelope, self.sample_top_m = envelope, sample_top_m
        if drafter.rope.cos.shape[0] < envelope.rope_len:
            raise FastdraftError(f"drafter rotary table ({drafter.rope.cos.shape[0]}) is shorter "
                                 f"than the engine's positions ({envelope.rope_len})")
        shape = (num_slots, cfg.num_key_value_heads, envelope.cache_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device)]
        self.root_feat = torch.zeros(num_slots, cfg.hidden_size, dtype=self.dtype,
                                     device=self.device)
        self._layouts: dict[tuple[int, int], DraftLayout] = {}

    @property
    def aux_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.drafter.aux_layers

    def kv(self, slot_start: int = 0) -> KVView:
        return KVView(self.k, self.v, slot_start)

    # -------------------------------------------------------------- keep the cache in step
    @torch.inference_mode()
    def on_prefill(self, requests: list[Request], hidden: HiddenStates, slot_start: int,
                   first_tokens: torch.Tensor, share: SharedPrefill | None = None) -> None:
        """Runs the drafter over each prompt's (feature of token t, token t + 1) pairs, the last
        one pairing the last prompt token with the first generated token. A GRPO group's equal
        prompts: their pairs but the last run once, every row of the group takes a copy of
        those cells (its own slot), then each row runs its own last pair (engine/
        prefix_share.py does the same for the policy)."""
        rows = torch.arange(len(requests), device=self.device)
        if share is None or not share.shared:
            out, last = self._pairs([r.prompt_token_ids for r in requests], hidden, slot_start,
                                    first_tokens)
            self._set_roots(slice(slot_start, slot_start + len(requests)), out[rows, last])
            return
        firsts = torch.tensor([share.source.index(i) for i in range(len(share.prompts))],
                              device=self.device)
        self._pairs(share.prompts, HiddenStates(hidden.final[firsts],
                                                tuple(a[firsts] for a in hidden.aux)),
                    slot_start, None)
        source = slot_start + share.rows(self.device)   # gathered before any slot is written
        lens = [len(r.prompt_token_ids) for r in requests]
        for cache in (*self.k, *self.v):   # the cells of the pairs: 1 .. longest prompt - 1
            cache[slot_start: slot_start + len(requests), :, : max(lens)] = \
                cache[source, :, : max(lens)]
        last = torch.tensor(lens, device=self.device) - 1
        pos = (last + 1).unsqueeze(1)
        feats = self.drafter.target_features(HiddenStates(
            hidden.final[rows, last].unsqueeze(1).to(self.dtype),
            tuple(a[rows, last].unsqueeze(1).to(self.dtype) for a in hidden.aux)))
        out = self.advance(feats, first_tokens.unsqueeze(1), pos, self.kv(slot_start),
                           AttnMeta(causal_pairs_mask(pos, max(lens) + 1),
                                    cache_positions=pos))
        self._set_roots(slice(slot_start, slot_start + len(requests)), out[:, 0])

    def _pairs(self, prompts: list[list[int]], hidden: HiddenStates, slot_start: int,
               first_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter over the prompts' pairs in slots slot_start.. -> (features [B, T, H],
        each row's last pair's column [B]). first_tokens None: the last pair (which needs the
        first generated token) is left out, its cell written with padding."""
        lens = [len(p) for p in prompts]
        width = hidden.final.shape[1]
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : lens[row] - 1] = torch.tensor(prompt[1:], dtype=torch.long)
        ids = ids.to(self.device)
        last = torch.tensor(lens, device=self.device) - 1
        if first_tokens is not None:
            ids[torch.arange(len(prompts), device=self.device), last] = first_tokens
        pos = torch.arange(1, width + 1, device=self.device).expand(len(prompts), -1)
        feats = self.drafter.target_features(HiddenStates(
            hidden.final.to(self.dtype), tuple(a.to(self.dtype) for a in hidden.aux)))
        return self.advance(feats, ids, pos, self.kv(slot_start),
                            AttnMeta(causal_pairs_mask(pos, width + 1),
                                     cache_positions=pos)), last

    def commit(self, io: StepIO, batch: int, ctx_len: int, width: int | None = None,
               start: int = 0) -> None:
        """The drafter over the accepted tokens + bonus of rows start..start+batch-1 (padding
        past each row's count writes cells the next step overwrites); each row's last features
        become the root of its next tree (logits are left to draft()).
        width: accepted columns to run (1 after a plain decode step; default all)."""
        width = width or io.commit_width
        rows = slice(start, start + batch)
        root_pos = io.root_pos[rows]
        pos = root_pos.unsqueeze(1) + 1 + torch.arange(width, device=self.device)
        feats = self.drafter.target_features(HiddenStates(
            io.commit_final[rows, :width], tuple(a[rows, :width] for a in io.commit_aux)))
        out = self.advance(feats, io.accepted_ids[rows, :width], pos, self.kv(start),
                           AttnMeta(causal_pairs_mask(pos, ctx_len), cache_positions=pos))
        last = io.num_accepted[rows].view(-1, 1, 1).expand(-1, 1, out.shape[-1])
        self._set_roots(rows, out.gather(1, last).squeeze(1))

    def _set_roots(self, slots: slice, features: torch.Tensor) -> None:
        # Only features: their logits are computed when a tree is drafted from them, so a
        # plain step that merely keeps the drafter in step reads no lm_head.
        self.root_feat[slots] = features

    def root_logits(self, batch: int) -> torch.Tensor:
        """[batch, draft vocab] fp32: the drafter's logits of each row's next token."""
        return self.head.logits(self.root_feat[:batch]).float()

    def move(self, moves: list[SlotMove]) -> None:
        for cache in (self.k[0], self.v[0]):
            move_slots(cache, moves, slot_dim=0, cell_dim=2)
        move_slots(self.root_feat, moves)

    def refresh(self) -> None:
        self.head.refresh()

    # ------------------------------------------------------------------------- draft trees
    def draft_width(self, cfg: SpecConfig) -> int:
        layout = self._layout(cfg.depth, min(cfg.topk, self.head.vocab_size))
        return min(cfg.tokens_to_verify, layout.num_candidates)

    def draft(self, io: StepIO, batch: int, ctx_len: int, cfg: SpecConfig,
              mode: SamplingMode) -> None:
        drafts = self.expand(io.root_pos[:batch], io.sampling.rows(batch), ctx_len, cfg, mode)
        assert io.drafts is not None
        io.drafts.store(drafts, batch, drafts.width)

    def expand(self, root_pos: torch.Tensor, st: SamplingTensors, ctx_len: int,
               cfg: SpecConfig, mode: SamplingMode) -> DraftBatch:
        """EAGLE-2 expansion of rows 0..B-1 (root_pos [B]) at once, then the best
        tokens_to_verify nodes."""
        batch = root_pos.shape[0]
        k = min(cfg.topk, self.head.vocab_size)
        layout = self._layout(cfg.depth, k)
        hidden = self.root_feat.shape[1]
        sampling = None if mode is SamplingMode.GREEDY else st
        num_scratch = layout.num_scratch
        # Expanded node s keeps its K/V in cell root_pos + 1 + s; scratch_anc[:, s] is its
        # scratch ancestors-or-self, filled in as the levels expand.
        scratch_anc = layout.scratch_eye.expand(batch, -1, -1).clone()               # [B, S, S]
        # Level l's nodes sit at root_pos + l: one rotary lookup serves every level.
        if cfg.depth > 1:
            rope = self.drafter.rope(root_pos.unsqueeze(1) + layout.level_offsets, self.dtype)
        draw = _Draw(self, sampling, mode, root_pos, k)
        tok, key, q = draw(self.root_logits(batch).unsqueeze(1),
                           layout.zero_key.expand(batch, -1), level=0)
        tokens, keys, q_rows = [tok.flatten(1)], [key.flatten(1)], [q]
        orders = []  # per expanded level: which of its candidates were expanded [B, k]
        out = self.root_feat[:batch].unsqueeze(1)                     # the root's features
        kv = self.kv()
        masks = TreeMask(root_pos, num_scratch, ctx_len, first_cell=1)
        for level in range(1, cfg.depth):
            new = slice((level - 1) * k, level * k)
            if level == 1:  # the root's children, already in key order
                f_key, f_tok, order = keys[0], tokens[0], layout.first_order.expand(batch, -1)
                feat = out.expand(-1, k, -1)
            else:
                f_key, order = keys[-1].topk(k, dim=1)                                # [B, k]
                f_tok = tokens[-1].gather(1, order)
                # Every parent was expanded at the level before: its features are in `out`.
                parent = (order // k).unsqueeze(-1)                                # [B, k, 1]
                feat = out.gather(1, parent.expand(-1, -1, hidden))
                prev = slice((level - 2) * k, (level - 1) * k)
                scratch_anc[:, new] |= scratch_anc[:, prev].gather(
                    1, parent.expand(-1, -1, num_scratch))
            orders.append(order)
            cells = root_pos.unsqueeze(1) + 1 + layout.scratch_cells[level - 1]      # [B, k]
            mask = masks(scratch_anc[:, new])
            out = self.advance(feat, f_tok, RopeTable(rope.cos[:, level - 1: level],
                                                      rope.sin[:, level - 1: level]), kv,
                               AttnMeta(mask, cache_positions=cells))
            tok, key, q = draw(self.head.logits(out), f_key, level)                # [B, k, k]
            tokens.append(tok.flatten(1))
            keys.append(key.flatten(1))
            q_rows.append(q)
        # Global candidate index of every expanded node, in scratch order.
        expanded = (torch.cat(orders, 1) + layout.scratch_level_start if orders
                    else torch.zeros(batch, 0, dtype=torch.long, device=self.device))
        drafts, node_scratch = select_tree(layout, torch.cat(tokens, 1), torch.cat(keys, 1),
                                           expanded, scratch_anc, cfg.tokens_to_verify,
                                           self.source_id, may_pad=sampling is not None)
        if sampling is None:
            return drafts
        # Sampled rows: the q each parent's children were drawn from (root row, then per node
        # the q of its expansion; rows of unexpanded nodes are unused).
        vocab = q_rows[0].shape[-1]
        if num_scratch:
            node_q = torch.cat(q_rows[1:], 1).gather(
                1, node_scratch.clamp_min(0).unsqueeze(-1).expand(-1, -1, vocab))
        else:  # depth 1: no node has children
            node_q = q_rows[0].expand(-1, drafts.width, -1)
        probs = torch.cat([q_rows[0], node_q], 1)
        is_sampled = (~sampling.is_greedy).unsqueeze(1).expand(-1, drafts.width)
        return replace(drafts, parent_probs=probs, is_sampled=is_sampled)

    def _layout(self, depth: int, k: int) -> DraftLayout:
        key = (depth, k)
        if key not in self._layouts:
            self._layouts[key] = DraftLayout.build(depth, k, self.device)
        return self._layouts[key]


class _Draw:
    """Children of a level's parents: drafter logits [B, K, Vd] + parent keys [B, K] ->
    (target token ids, keys) [B, K, k] in key order, and the target-vocabulary q [B, K, V]
    they were drawn from (None when every row is greedy). Greedy rows: the top-k of q, key =
    parent key + log q. Sampling rows: k draws without replacement from q (over its top m),
    keyed by the top-down Gumbel conditioned on the parent key."""

    def __init__(self, proposer: EagleProposer, sampling: SamplingTensors | None,
                 mode: SamplingMode, root_pos: torch.Tensor, k: int) -> None:
        self.head, self.sampling, self.mode = proposer.head, sampling, mode
        self.k = k
        self.top_m = min(max(proposer.sample_top_m, k), proposer.head.vocab_size)
        self.vocab = proposer.drafter.config.vocab_size
        self.keys = None if sampling is None else sampling.key(Stream.DRAFT)
        self.root_cells = root_pos.view(-1, 1, 1)

    def __call__(self, logits: torch.Tensor, parent_key: torch.Tensor, level: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k, st = self.k, self.sampling
        if st is None:  # greedy: log-softmax is finite, so keys are too
            top = (parent_key.unsqueeze(-1) + logits.float().log_softmax(-1)).topk(k, dim=-1)
            return self.head.to_target(top.indices), top.values, None
        scaled, filtered = st.scale_and_filter(logits, self.mode.needs_filter)
        if self.mode.needs_filter:  # greedy rows rank children by their unfiltered q
            filtered = torch.where(st.is_greedy.view(-1, 1, 1), scaled, filtered)
        q_raw = filtered.softmax(-1)                                              # [B, K, m]
        if self.top_m < q_raw.shape[-1]:
            q_raw, cand = q_raw.topk(self.top_m, dim=-1)
        else:  # every token is a candidate
            cand = torch.arange(q_raw.shape[-1], device=q_raw.device).expand_as(q_raw)
        q_top = q_raw / q_raw.sum(-1, keepdim=True)
        # log of the very q that verification divides by: q = 0 (filtered or underflowed)
        # gives -inf, so such a child is never drawn.
        log_q = q_top.log()
        batch, parents, m = q_top.shape
        index = torch.arange(parents * m, device=logits.device).view(parents, m)
        counters = draft_counter(self.root_cells, level, index)
        noise = -uniform_keyed(self.keys, counters).log().float()                    # Exp(1)
        picked, keys = conditioned_gumbel_topk(log_q, parent_key, k, noise)
        greedy = (parent_key.unsqueeze(-1) + q_raw.log()).topk(k, dim=-1)
        is_greedy = st.is_greedy.view(-1, 1, 1)
        picked = torch.where(is_greedy, greedy.indices, picked)
        keys = torch.where(is_greedy, greedy.values, keys)
        target_cand = self.head.to_target(cand)
        q_full = torch.zeros(batch, parents, self.vocab, device=logits.device).scatter_(
            -1, target_cand, q_top)
        # Children of a non-candidate (-inf key) come out -inf too (see probs._condition).
        return target_cand.gather(-1, picked), keys, q_full


@register_proposer("eagle")
def create_eagle_proposer(*, model: CausalLM, drafter_path: str | Path | None, num_slots: int,
                          envelope: Envelope, compile: bool = False,
                          **_: object) -> EagleProposer:
    """Loads the drafter (checked against the policy: a mismatch fails at engine start)."""
    if drafter_path is None:
        raise FastdraftError("spec method 'eagle' needs drafter=PATH: train one with "
                             "`fastdraft drafter warmup --policy DIR`")
    from fastdraft.drafter import load_drafter
    drafter = load_drafter(drafter_path, model, max_positions=envelope.rope_len)
    return EagleProposer(drafter=drafter, num_slots=num_slots, envelope=envelope,
                         compile=compile)
