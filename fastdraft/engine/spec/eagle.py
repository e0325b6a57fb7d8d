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

import heapq
from pathlib import Path

import torch

from fastdraft.drafter.base import Drafter
from fastdraft.engine.request import Request
from fastdraft.engine.spec.config import SpecConfig
from fastdraft.engine.spec.probs import conditioned_gumbel_keys, processed_probs
from fastdraft.engine.spec.proposer import Committed, Proposer, register_proposer
from fastdraft.engine.spec.tree import ROOT, DraftTree
from fastdraft.models import AttnMeta, CausalLM, HiddenStates, KVView
from fastdraft.models.packing import pack_for_inference


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
        batch, width, hidden = len(committed), max(lens), self.drafter.config.hidden_size
        final = torch.zeros(batch, width, hidden, dtype=self.dtype, device=self.device)
        aux = [torch.zeros_like(final) for _ in self.aux_layers]
        ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        pos = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        for b, c in enumerate(committed):
            n = lens[b]
            final[b, :n] = c.final
            for a, src in zip(aux, c.aux):
                a[b, :n] = src
            ids[b, :n] = torch.tensor(c.token_ids, device=self.device)
            # Padding rows write junk past the request's end, where nothing reads it.
            pos[b] = torch.arange(c.start_pos, c.start_pos + width).clamp_max(self.cache_len - 1)
        feats = self.drafter.target_features(HiddenStates(final, tuple(aux)))
        cols = torch.arange(int(pos.max()) + 1, device=self.device)
        mask = (cols >= 1) & (cols <= pos.unsqueeze(-1))  # position 0 never holds a pair
        slots = torch.tensor([c.request.slot for c in committed], device=self.device)
        out, logits = self.draft_step(feats, ids, pos, KVView(self.k, self.v, slots),
                                        AttnMeta(mask, cache_positions=pos))
        for b, c in enumerate(committed):
            slot, last = c.request.slot, lens[b] - 1
            self.root_feat[slot] = out[b, last]
            self.root_logits[slot] = logits[b, last].float()
            self.root_pos[slot] = c.start_pos + last

    # ------------------------------------------------------------------------- draft trees
    @torch.inference_mode()
    def propose(self, requests: list[Request], cfg: SpecConfig) -> list[DraftTree]:
        batch, k = len(requests), cfg.topk
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        root_pos = torch.tensor([self.root_pos[r.slot] for r in requests], device=self.device)
        greedy = [r.params.is_greedy for r in requests]
        q_root = _probs(self.root_logits[slots].unsqueeze(1), requests)[:, 0]   # [B, V]
        zero = torch.zeros(batch, 1, device=self.device)
        tok, key = _draw(q_root.unsqueeze(1), zero, k, requests)             # [B, 1, k]
        tok, key = tok[:, 0], key[:, 0]                                      # level 1: [B, k]
        levels = [(tok, key, torch.full_like(tok, ROOT))]  # (tokens, cum key, parent scratch)
        scratch_q: list[torch.Tensor] = []                 # q of each expanded node [B, k, V]
        anc = torch.zeros(batch, 0, 0, dtype=torch.bool, device=self.device)
        feat_of_scratch = torch.zeros(batch, 0, self.root_feat.shape[1], dtype=self.dtype,
                                      device=self.device)
        for depth in range(1, cfg.depth):
            tok, key, parent = levels[-1]
            order = key.topk(min(k, key.shape[1]), dim=1).indices              # frontier [B, K]
            f_tok, f_parent = tok.gather(1, order), parent.gather(1, order)
            num_f = f_tok.shape[1]
            start = feat_of_scratch.shape[1]
            new_scratch = torch.arange(start, start + num_f, device=self.device)
            # Features of each frontier node's parent: the root's, or an expanded node's output.
            parent_feat = torch.where(
                (f_parent == ROOT).unsqueeze(-1), self.root_feat[slots].unsqueeze(1),
                feat_of_scratch.gather(1, f_parent.clamp_min(0).unsqueeze(-1).expand(
                    -1, -1, feat_of_scratch.shape[2])) if start else
                self.root_feat[slots].unsqueeze(1))
            anc = _grow_ancestors(anc, f_parent, num_f)
            cache_pos = root_pos.unsqueeze(1) + 1 + new_scratch.unsqueeze(0)
            positions = (root_pos + depth).unsqueeze(1).expand(-1, num_f)
            mask = _tree_mask(root_pos, anc[:, start:], int(cache_pos.max()) + 1)
            out, logits = self.draft_step(parent_feat, f_tok, positions,
                                            KVView(self.k, self.v, slots),
                                            AttnMeta(mask, cache_positions=cache_pos))
            feat_of_scratch = torch.cat([feat_of_scratch, out], 1)
            q = _probs(logits, requests)                                       # [B, K, V]
            scratch_q.append(q)
            c_tok, c_key = _draw(q, key.gather(1, order), k, requests)         # [B, K, k]
            levels[-1] = (tok, key, parent, order, new_scratch)  # type: ignore[assignment]
            levels.append((c_tok.flatten(1), c_key.flatten(1),
                           new_scratch.repeat_interleave(k).expand(batch, -1)))
        q_all = torch.cat(scratch_q, 1) if scratch_q else None
        return [_select(levels, b, cfg.tokens_to_verify, q_root[b],
                        None if q_all is None else q_all[b], greedy[b], self.source_id)
                for b in range(batch)]


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


def _probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """[B, K, V] logits -> draft probabilities q, each row with its request's params (greedy
    requests rank children by the plain softmax; their trees are verified by argmax)."""
    return torch.stack([logits[b].float().softmax(-1) if r.params.is_greedy
                        else processed_probs(logits[b].float(), r.params)
                        for b, r in enumerate(requests)])


def _draw(q: torch.Tensor, parent_key: torch.Tensor, k: int, requests: list[Request]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, K, V], parent_key [B, K] -> (tokens, keys) [B, K, k]. Greedy rows: the top-k of q,
    key = parent key + log q. Sampling rows: k draws without replacement from q, in draw order,
    with keys conditioned on the parent key (top-down Gumbel)."""
    keys = parent_key.unsqueeze(-1) + q.clamp_min(1e-30).log()
    for b, r in enumerate(requests):
        if not r.params.is_greedy:
            log_q = torch.where(q[b] > 0, q[b].log(), float("-inf"))
            keys[b] = conditioned_gumbel_keys(log_q, parent_key[b], r.generator)
    top = keys.topk(min(k, q.shape[-1]), dim=-1)
    return top.indices, top.values


def _grow_ancestors(anc: torch.Tensor, f_parent: torch.Tensor, num_new: int) -> torch.Tensor:
    """anc [B, S, S] (row s = ancestors-or-self of expanded node s) -> with num_new nodes added,
    each inheriting its parent's row (f_parent [B, num_new], ROOT = none)."""
    batch, s = anc.shape[0], anc.shape[1]
    grown = torch.zeros(batch, s + num_new, s + num_new, dtype=torch.bool, device=anc.device)
    grown[:, :s, :s] = anc
    if s:
        inherited = anc.gather(1, f_parent.clamp_min(0).unsqueeze(-1).expand(-1, -1, s))
        grown[:, s:, :s] = inherited & (f_parent >= 0).unsqueeze(-1)
    grown[:, s:, s:] = torch.eye(num_new, dtype=torch.bool, device=anc.device)
    return grown


def _tree_mask(root_pos: torch.Tensor, anc_rows: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """[B, K, ctx_len]: committed pairs 1..root_pos, plus the scratch slots of each node's
    expanded ancestors-or-self (scratch s lives at cache position root_pos + 1 + s)."""
    batch, num, num_scratch = anc_rows.shape
    cols = torch.arange(ctx_len, device=root_pos.device)
    mask = ((cols >= 1) & (cols <= root_pos.view(-1, 1, 1))).expand(batch, num, -1).clone()
    scratch_cols = root_pos.view(-1, 1, 1) + 1 + torch.arange(num_scratch, device=cols.device)
    mask.scatter_(2, scratch_cols.expand(-1, num, -1), anc_rows)
    return mask


def _select(levels: list, b: int, budget: int, q_root: torch.Tensor, q_scratch: torch.Tensor | None,
            is_greedy: bool, source_id: int) -> DraftTree:
    """Best-first by key from the root (ties: the earlier-created node first), so every kept
    node's parent is kept and kept siblings are a prefix of their draw order. Returns request
    b's DraftTree."""
    children: dict[int, list[tuple[float, int]]] = {}
    scratch_of: dict[tuple[int, int], int] = {}  # (level, index in level) -> scratch id
    tokens_by: dict[tuple[int, int], int] = {}
    for lvl, entry in enumerate(levels):
        tok, key, parent = entry[0][b].tolist(), entry[1][b].tolist(), entry[2][b].tolist()
        if len(entry) == 5:  # expanded level: frontier order -> scratch ids
            for idx, s in zip(entry[3][b].tolist(), entry[4].tolist()):
                scratch_of[(lvl, idx)] = s
        for i, (t, kv, p) in enumerate(zip(tok, key, parent)):
            if kv == float("-inf"):
                continue
            children.setdefault(p, []).append((-kv, lvl, i))  # type: ignore[arg-type]
            tokens_by[(lvl, i)] = t
    heap = list(children.get(ROOT, []))
    heapq.heapify(heap)
    out_tok, out_parent, out_scratch = [], [], []
    node_of_scratch: dict[int, int] = {}
    while heap and len(out_tok) < budget:
        _, lvl, i, *rest = heapq.heappop(heap)
        parent_node = rest[0] if rest else ROOT
        node = len(out_tok)
        out_tok.append(tokens_by[(lvl, i)])
        out_parent.append(parent_node)
        s = scratch_of.get((lvl, i))
        out_scratch.append(-1 if s is None else s)
        if s is not None:
            node_of_scratch[s] = node
            for neg_key, c_lvl, c_i in children.get(s, []):
                heapq.heappush(heap, (neg_key, c_lvl, c_i, node))
    device = q_root.device
    tokens = torch.tensor(out_tok, dtype=torch.long, device=device)
    parents = torch.tensor(out_parent, dtype=torch.long, device=device)
    sources = torch.full((len(out_tok),), source_id, dtype=torch.int8, device=device)
    if is_greedy:
        return DraftTree(tokens, parents, None, None, sources)
    probs = torch.zeros(len(out_tok) + 1, q_root.shape[-1], device=device)
    probs[0] = q_root
    for node, s in enumerate(out_scratch):
        if s >= 0 and q_scratch is not None:
            probs[node + 1] = q_scratch[s]
    is_sampled = torch.ones(len(out_tok) + 1, dtype=torch.bool, device=device)
    return DraftTree(tokens, parents, probs, is_sampled, sources)
