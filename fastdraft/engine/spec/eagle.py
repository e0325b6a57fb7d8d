"""EAGLE proposer: EAGLE-2 style dynamic draft trees from a trained drafter, batched over requests.

Per level, the `topk` best frontier nodes of every request run through the drafter in ONE forward
(tree attention over the drafter's own slot cache), each proposes `topk` children, and the best
`tokens_to_verify` nodes are kept. Greedy requests rank by cumulative draft log-probability and
verify children as point masses. Sampling requests draw children WITHOUT replacement from q with
the top-down Gumbel of Stochastic Beam Search (keys conditioned on their parent's key, so keys
never increase along a path): the best-first top-M is then a tree whose kept children are always
a prefix of their draw order, which recursive rejection sampling needs to stay lossless. (Naive
cumulative perturbed keys are NOT lossless after pruning; tests/engine/spec shows the bias.)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from fastdraft.drafter.base import Drafter
from fastdraft.engine.request import Request
from fastdraft.engine.sampler import SamplingTensors
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.config import SpecConfig
from fastdraft.engine.spec.draft_layout import DraftLayout, select_tree
from fastdraft.engine.spec.probs import conditioned_gumbel_topk
from fastdraft.engine.spec.proposer import Committed, Proposer, register_proposer
from fastdraft.models import AttnMeta, CausalLM, HiddenStates
from fastdraft.models.attn_meta import KVViews
from fastdraft.models.packing import pack_for_inference
from fastdraft.models.rope import RopeTable


class EagleProposer(Proposer):
    source_id = 0

    def __init__(self, *, drafter: Drafter, num_slots: int, cache_len: int, spec: SpecConfig,
                 compile: bool = False, **_: object) -> None:
        self.drafter = pack_for_inference(drafter)  # in place: published weights still load
        self.draft_step = (torch.compile(drafter.step, dynamic=True) if compile
                           else drafter.step)
        cfg = drafter.config
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.spec = spec
        self.num_scratch = max(spec.depth - 1, 0) * spec.topk  # expanded nodes per tree
        self.cache_len = cache_len + self.num_scratch + spec.depth + 2
        if drafter.rope.cos.shape[0] < self.cache_len:
            raise ValueError(f"drafter rotary table ({drafter.rope.cos.shape[0]}) is shorter "
                             f"than its cache ({self.cache_len}): build it with more positions")
        shape = (num_slots, cfg.num_key_value_heads, self.cache_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device)]
        self.root_feat = torch.zeros(num_slots, cfg.hidden_size, dtype=self.dtype,
                                     device=self.device)
        self.root_logits = torch.zeros(num_slots, cfg.vocab_size, device=self.device)
        self.root_pos = [0] * num_slots
        self._kv = KVViews(self.k, self.v)
        self._layouts: dict[tuple[int, int], DraftLayout] = {}
        # Column indices for the committed-pairs mask; column 0 never holds a pair, so it gets
        # an index no root position reaches.
        self._cols = torch.arange(self.cache_len, device=self.device)
        self._cols[0] = self.cache_len

    @property
    def aux_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.drafter.aux_layers

    # -------------------------------------------------------------- keep the cache in step
    @torch.inference_mode()
    def on_commit(self, committed: list[Committed]) -> None:
        """Runs the drafter over each request's new (policy feature, next token) pairs."""
        if not committed:
            return
        lens = [len(c.token_ids) for c in committed]
        width, dev = max(lens), self.device
        final = _pad([c.final for c in committed])
        aux = tuple(_pad(list(layer)) for layer in zip(*(c.aux for c in committed)))
        # Padding rows write junk past the request's end, where nothing reads it.
        top = self.cache_len - 1
        ids, pos = torch.tensor(
            [[c.token_ids + [0] * (width - len(c.token_ids)) for c in committed],
             [[min(p, top) for p in range(c.start_pos, c.start_pos + width)] for c in committed]],
            device=dev)
        feats = self.drafter.target_features(HiddenStates(final.to(self.dtype), aux))
        ctx_len = min(max(c.start_pos for c in committed) + width, self.cache_len)
        mask = self._cols[:ctx_len] <= pos.unsqueeze(-1)
        slot_list = [c.request.slot for c in committed]
        out, logits = self.draft_step(feats, ids, pos, self._kv(slot_list),
                                      AttnMeta(mask, cache_positions=pos))
        rows, last, slots = torch.tensor([list(range(len(committed))), [n - 1 for n in lens],
                                          slot_list], device=dev)
        self.root_feat[slots] = out[rows, last]
        self.root_logits[slots] = logits[rows, last].float()
        for c, n in zip(committed, lens):
            self.root_pos[c.request.slot] = c.start_pos + n - 1

    # ------------------------------------------------------------------------- draft trees
    @torch.inference_mode()
    def propose(self, requests: list[Request], cfg: SpecConfig) -> DraftBatch:
        """EAGLE-2 expansion of every request at once, then the best tokens_to_verify nodes."""
        batch, vocab = len(requests), self.root_logits.shape[1]
        k = min(cfg.topk, vocab)
        layout = self._layout(cfg.depth, k)
        dev, hidden = self.device, self.root_feat.shape[1]
        slot_list = [r.slot for r in requests]
        root_pos_list = [self.root_pos[s] for s in slot_list]
        slots, root_pos = torch.tensor([slot_list, root_pos_list], device=dev)
        root_pos = root_pos.unsqueeze(1)                                              # [B, 1]
        sampling = _sampling_rows(requests, vocab, dev)
        kv = self._kv(slot_list)
        # Expanded node s keeps its K/V in cell start + s, past every row's committed pairs.
        # mask[:, s] is what node s attends to: its row's committed pairs, then its scratch
        # ancestors-or-self (the columns past start, filled in as the levels expand).
        start, num_scratch = max(root_pos_list) + 1, layout.num_scratch
        mask = torch.empty(batch, num_scratch, start + num_scratch, dtype=torch.bool, device=dev)
        mask[:, :, :start] = (self._cols[:start] <= root_pos).unsqueeze(1)
        scratch_anc = mask[:, :, start:]                                              # [B, S, S]
        scratch_anc.copy_(layout.scratch_eye)                                            # self
        cells = start + layout.scratch_cells                                          # [D-1, k]
        # Level l's nodes sit at root_pos + l: one rotary lookup serves every level.
        if cfg.depth > 1:
            rope = self.drafter.rope(root_pos + layout.level_offsets, self.dtype)  # [B, D-1, 1, hd]

        log_q, q = _draft_dist(self.root_logits[slots].unsqueeze(1), sampling)      # [B, 1, V]
        tok, key = _children(log_q, layout.zero_key.expand(batch, -1), k, requests, sampling)
        tokens, keys, q_rows = [tok.flatten(1)], [key.flatten(1)], [q]
        orders = []  # per expanded level: which of its candidates were expanded [B, k]
        out = self.root_feat[slots].unsqueeze(1)                     # the root's features
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
            out, logits = self.draft_step(
                feat, f_tok, RopeTable(rope.cos[:, level - 1: level],
                                       rope.sin[:, level - 1: level]), kv,
                AttnMeta(mask[:, new], cache_positions=cells[level - 1].expand(batch, -1)))
            log_q, q = _draft_dist(logits, sampling)                                # [B, k, V]
            tok, key = _children(log_q, f_key, k, requests, sampling)              # [B, k, k]
            tokens.append(tok.flatten(1))
            keys.append(key.flatten(1))
            q_rows.append(q)
        # Global candidate index of every expanded node, in scratch order.
        expanded = (torch.cat(orders, 1) + layout.scratch_level_start if orders
                    else torch.zeros(batch, 0, dtype=torch.long, device=dev))
        drafts, node_scratch = select_tree(layout, torch.cat(tokens, 1), torch.cat(keys, 1),
                                           expanded, scratch_anc, cfg.tokens_to_verify,
                                           self.source_id, may_pad=sampling is not None)
        if sampling is None:
            return drafts
        # Sampled rows: the q each parent's children were drawn from (root row, then per node
        # the q of its expansion; rows of unexpanded nodes are unused).
        if num_scratch:
            node_q = torch.cat(q_rows[1:], 1).gather(
                1, node_scratch.clamp_min(0).unsqueeze(-1).expand(-1, -1, vocab))
        else:  # depth 1: no node has children
            node_q = q_rows[0].expand(-1, drafts.width, -1)
        probs = torch.cat([q_rows[0], node_q], 1)
        is_sampled = (~sampling.is_greedy).unsqueeze(1).expand(-1, probs.shape[1])
        return replace(drafts, parent_probs=probs, is_sampled=is_sampled)

    def _layout(self, depth: int, k: int) -> DraftLayout:
        key = (depth, k)
        if key not in self._layouts:
            self._layouts[key] = DraftLayout.build(depth, k, self.device)
        return self._layouts[key]


@register_proposer("eagle")
def create_eagle_proposer(*, model: CausalLM, drafter_path: str | Path | None, num_slots: int,
                          cache_len: int, spec: SpecConfig, compile: bool = False,
                          **_: object) -> EagleProposer:
    """Loads the drafter (checked against the policy: a mismatch fails at engine start)."""
    if drafter_path is None:
        raise ValueError("spec method 'eagle' needs drafter=PATH: train one with "
                         "`fastdraft drafter warmup --policy DIR`")
    from fastdraft.drafter import load_drafter
    positions = cache_len + max(spec.depth - 1, 0) * spec.topk + spec.depth + 2
    drafter = load_drafter(drafter_path, model, max_positions=positions)
    return EagleProposer(drafter=drafter, num_slots=num_slots, cache_len=cache_len, spec=spec,
                         compile=compile)


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """[n_b, H] rows -> [B, max n_b, H], zero-padded (a view when there is a single row)."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else pad_sequence(rows, batch_first=True)


def _sampling_rows(requests: list[Request], vocab: int, device: torch.device
                   ) -> SamplingTensors | None:
    """Per-row sampling settings, or None when every request is greedy (the fast path)."""
    if all(r.params.is_greedy for r in requests):
        return None
    return SamplingTensors.build([r.params for r in requests], vocab, device)


def _draft_dist(logits: torch.Tensor, sampling: SamplingTensors | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, K, V] drafter logits -> (log q, q or None). Greedy rows rank children by the plain
    softmax (their trees are verified by argmax); sampling rows draw from q processed with the
    row's own temperature / top-k / top-p, and q is what verification divides by."""
    if sampling is None:
        return logits.float().log_softmax(-1), None
    scaled, filtered = sampling.scale_and_filter(logits)   # greedy rows: temperature 1
    if sampling.needs_filter:  # greedy rows rank children by their unfiltered q
        filtered = torch.where(sampling.is_greedy.view(-1, 1, 1), scaled, filtered)
    q = filtered.softmax(-1)   # filtered-out tokens: -inf, so q = 0 exactly
    # log of the very q that verification divides by: q = 0 (filtered or underflowed) gives
    # -inf, so such a child is never drawn.
    return q.log(), q


def _children(log_q: torch.Tensor, parent_key: torch.Tensor, k: int, requests: list[Request],
              sampling: SamplingTensors | None) -> tuple[torch.Tensor, torch.Tensor]:
    """log_q [B, K, V], parent_key [B, K] -> (tokens, keys) [B, K, k] in key order. Greedy rows:
    the top-k of q, key = parent key + log q. Sampling rows: k draws without replacement from q,
    in draw order, keyed by the top-down Gumbel conditioned on the parent key."""
    if sampling is None:  # greedy: log-softmax is finite, so keys are too
        top = (parent_key.unsqueeze(-1) + log_q).topk(k, dim=-1)
        return top.indices, top.values
    # Exp(1) noise: seeded requests from their own generator, the others from the global RNG.
    generators = [r.generator for r in requests]
    noise = torch.empty_like(log_q)
    if None in generators:
        noise.exponential_()
    for b, gen in enumerate(generators):
        if gen is not None:
            noise[b].exponential_(generator=gen)
    if not sampling.any_greedy:
        tokens, keys = conditioned_gumbel_topk(log_q, parent_key, k, noise)
    else:
        greedy = (parent_key.unsqueeze(-1) + log_q).topk(k, dim=-1)
        tokens, keys = conditioned_gumbel_topk(log_q, parent_key, k, noise)
        is_greedy = sampling.is_greedy.view(-1, 1, 1)
        tokens = torch.where(is_greedy, greedy.indices, tokens)
        keys = torch.where(is_greedy, greedy.values, keys)
    # Children of a non-candidate (-inf key) come out -inf too (see probs._condition).
    return tokens, keys
