"""The one place that touches the policy on the device: owns the model and its KV cache (paged,
engine/paged_kv.py, or static slots) and turns a step's static inputs into a forward pass. Every
method here takes device tensors and Python sizes only (a batch bucket, a context bucket), so
the same calls run eagerly and inside captured CUDA graphs; prefill alone is eager (prompt
lengths vary too much to capture)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdraft.engine.envelope import Envelope
from fastdraft.engine.paged_kv import PagedKV
from fastdraft.engine.prefix_share import SharedPrefill
from fastdraft.engine.ragged_reads import plan_reads
from fastdraft.engine.scheduler import SlotMove
from fastdraft.engine.slot_state import move_slots
from fastdraft.engine.spec.accept import AcceptedBatch
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.errors import FastdraftError
from fastdraft.models import AttnMeta, CausalLM, HiddenStates, KVView, causal_cache_meta
from fastdraft.models.attn_meta import GroupedAttn, RowGroup, tree_mask
from fastdraft.models.packing import pack_for_inference


class ModelRunner:
    """compile=True runs the policy's forward through torch.compile (dynamic shapes, CPU and
    GPU): fused kernels for the norms, rotations and activations between the matmuls. Graph
    capture (engine/graphs.py) then replays the compiled kernels."""

    def __init__(self, model: CausalLM, envelope: Envelope, num_slots: int,
                 compile: bool = False, block_size: int = 0,
                 num_blocks: int | None = None, paged_attention: str = "gather",
                 staging: bool = False) -> None:
        """block_size > 0: the policy's KV in a paged pool of num_blocks blocks (None: as many
        as static slots would hold; engine/paged_kv.py); 0: every slot owns cache_len cells.
        paged_attention: how paged decode and verify steps attend: "gather" (each row's blocks
        copied into a padded context, then SDPA) or "triton" (kernels/triton_paged_attention.py
        reads them in place). staging: one slot more, past every batch bucket, where a prompt
        prefilled in chunks builds its cache (prefill_staged) before it lands in its slots."""
        self.model = pack_for_inference(model)
        self.forward = torch.compile(self.model, dynamic=True) if compile else self.model
        self.compiled = compile
        cfg = model.local_config   # (a tensor-parallel rank caches its own KV heads)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.envelope = envelope
        self.staging = num_slots if staging else None
        self._staged: list[HiddenStates] = []   # the staged prompt's chunks so far
        num_slots += int(staging)
        self.pages = (PagedKV(cfg, num_slots, envelope.cache_len, block_size, num_blocks,
                              self.dtype, self.device) if block_size else None)
        self.paged_attention = paged_attention_of(paged_attention, block_size, cfg.head_dim)
        # Paged reads chunked by row length (engine/ragged_reads.py) plan on the host: the
        # engine switches them on where it takes eager shortcuts (a graph needs one read; a
        # compiled forward would recompile for every new chunking).
        self.ragged_reads = False
        # One tensor for every layer's K and V: moving accepted draft K/V is then one copy.
        self.kv_cache = self.pages.kv if self.pages is not None else torch.zeros(
            cfg.num_hidden_layers, 2, num_slots, cfg.num_key_value_heads, envelope.cache_len,
            cfg.head_dim, dtype=self.dtype, device=self.device)
        self.k_cache = list(self.kv_cache[:, 0].unbind(0))
        self.v_cache = list(self.kv_cache[:, 1].unbind(0))

    def kv(self, slot_start: int, attn: AttnMeta, rows: torch.Tensor | None = None,
           decode: bool = False, tree: torch.Tensor | None = None) -> KVView:
        """The cache of rows slot_start.. for a forward writing attn.cache_positions [B, T]
        (paged: the table rows `rows` [B] instead, when given). decode: a one-token step; tree:
        a verify step's [B, T, T] mask over its own cells (root first, cells consecutive
        after the row's context); both may be served by the paged attention kernel."""
        positions = attn.cache_positions
        assert positions is not None
        num_rows = positions.shape[0]
        if self.pages is None:
            row_ids = torch.arange(num_rows, device=self.device).unsqueeze(1)
            return KVView(self.k_cache, self.v_cache, slot_start, row_ids)
        table = (self.pages.table[rows] if rows is not None
                 else self.pages.table[slot_start: slot_start + num_rows])
        write_at = self.pages.cells(table, positions)
        if self.paged_attention is not None and (decode or tree is not None):
            return KVView(self.k_cache, self.v_cache, table=table, write_at=write_at,
                          paged_attention=self.paged_attention,
                          ctx_lens=positions[:, -1] + 1, new_mask=tree)
        if not self.ragged_reads:   # (a graph or a compiled forward: one read, no host plan)
            return KVView(self.k_cache, self.v_cache, table=table, write_at=write_at)
        if num_rows == 1:
            slot = int(rows[0]) if rows is not None else slot_start
            return KVView(self.k_cache, self.v_cache, table=table, write_at=write_at,
                          span_start=self.pages.span(slot, attn.ctx_len))
        chunks = (plan_reads(attn.mask, table, self.pages.block_size, self.dtype)
                  if attn.mask is not None else None)
        return KVView(self.k_cache, self.v_cache, table=table, write_at=write_at, chunks=chunks)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slot_start: int,
                aux_layers: tuple[int, ...] = (), rows: torch.Tensor | None = None,
                start: int = 0) -> tuple[torch.Tensor, HiddenStates]:
        """Right-padded batched prefill of slots slot_start.. (paged: of table rows `rows`, if
        given) -> (last prompt token's logits [B, V], hidden states of every prompt token
        [B, T, H]). Padding writes junk K/V past each prompt's end, which decode overwrites
        before anything reads it (paged: past a row's blocks, into the sink). start > 0: the
        cells before it hold the prompts' first tokens already; positions start.. are computed
        (a chunk), attending to them (the last token's logits: of prompts ending in the chunk)."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width - start, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt) - start] = torch.tensor(prompt[start:])
        positions = torch.arange(start, width, device=self.device).expand(len(prompts), -1)
        last = torch.tensor([[max(len(p) - 1 - start, 0)] for p in prompts], device=self.device)
        attn = causal_cache_meta(positions, width)
        logits, hidden = self.model(ids.to(self.device), positions,
                                    self.kv(slot_start, attn, rows), attn, logit_index=last,
                                    aux_layers=aux_layers)
        return logits[:, 0], hidden

    def prefill_shared(self, share: SharedPrefill, slot_start: int,
                       aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, HiddenStates]:
        """prefill() of every row of `share`, computing each distinct prompt once: slot
        slot_start + i then takes its prompt's cells (gathered before anything is written: a
        computed slot may also be another prompt's row), row i its logits and hidden states.
        Paged: each prompt's first row takes blocks and is computed, its other rows hold the
        same blocks by reference (copied on their first write): nothing is copied here."""
        if self.pages is not None:
            firsts = self._admit(share, slot_start)
            logits, hidden = self.prefill(share.prompts, slot_start, aux_layers,
                                          torch.tensor(firsts, device=self.device))
        else:
            logits, hidden = self.prefill(share.prompts, slot_start, aux_layers)
        if not share.shared:
            return logits, hidden
        rows = share.rows(logits.device)
        if self.pages is None:
            width, end = max(len(p) for p in share.prompts), slot_start + rows.shape[0]
            self.kv_cache[:, :, slot_start:end, :, :width] = \
                self.kv_cache[:, :, slot_start + rows, :, :width]
        return logits[rows], HiddenStates(hidden.final[rows], tuple(a[rows] for a in hidden.aux))

    def prefill_staged(self, prompt: list[int], lo: int, hi: int,
                       aux_layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, HiddenStates] | None:
        """Positions lo..hi-1 of `prompt` into the staging slot (chunks in order, from 0).
        Before the last chunk None; at it (hi == len(prompt)) what prefill() of the whole prompt
        returns: its last token's logits [1, V] and every position's hidden states [1, L, H]
        (kept chunk by chunk here)."""
        slot = self.staging
        assert slot is not None, "the runner was built without a staging slot"
        rows = None
        if lo == 0:
            self._staged = []
            if self.pages is not None:
                self.pages.admit(slot, prompt)
        if self.pages is not None:
            rows = torch.tensor([slot], device=self.device)
        logits, hidden = self.prefill([prompt[:hi]], slot, aux_layers, rows, start=lo)
        self._staged.append(hidden)
        if hi < len(prompt):
            return None
        parts, self._staged = self._staged, []
        return logits, HiddenStates(torch.cat([p.final for p in parts], 1),
                                    tuple(torch.cat(a, 1) for a in zip(*(p.aux for p in parts))))

    def land_staged(self, num_rows: int, slot_start: int, num_cells: int) -> None:
        """The staged prompt's cache (its first num_cells cells) becomes slots slot_start ..
        slot_start + num_rows - 1's: paged, the first takes its blocks and the others share
        them (copied on their first write); static slots copy the cells."""
        slot = self.staging
        assert slot is not None, "the runner was built without a staging slot"
        if self.pages is not None:
            self.pages.move([SlotMove(slot, slot_start, num_cells)])
            for row in range(1, num_rows):
                self.pages.fork(slot_start + row, slot_start)
            return
        self.kv_cache[:, :, slot_start: slot_start + num_rows, :, :num_cells] = \
            self.kv_cache[:, :, slot: slot + 1, :, :num_cells]

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx_len: int,
               sees_all: bool = False, aux_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, HiddenStates]:
        """token_ids, positions [B] of slots 0..B-1 -> (logits [B, V], hidden [B, 1, H]);
        ctx_len: a bucket above every row's position. sees_all: the caller knows every row sits
        at ctx_len - 1 (no padding): attention then runs without a mask."""
        pos = positions.unsqueeze(1)
        attn = (AttnMeta(None, cache_positions=pos, cache_len=ctx_len) if sees_all
                else causal_cache_meta(pos, ctx_len))
        logits, hidden = self.forward(token_ids.unsqueeze(1), pos,
                                      self.kv(0, attn, decode=True), attn,
                                      aux_layers=aux_layers)
        return logits[:, 0], hidden

    def verify(self, root_ids: torch.Tensor, root_pos: torch.Tensor, drafts: DraftBatch,
               ctx_len: int, aux_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, HiddenStates]:
        """One forward over [root, tree nodes] per row -> (logits [B, 1 + N, V], hidden
        [B, 1 + N, H]). The root sits at its position root_pos; node i at root_pos + depth(i),
        its K/V in cell root_pos + 1 + i of its own slot; each node sees its row's context and
        its own ancestors."""
        ids, pos, attn = _tree_inputs(root_ids, root_pos, drafts, ctx_len)
        return self.forward(ids, pos, self.kv(0, attn, tree=self._own_cells(drafts)), attn,
                            aux_layers=aux_layers)

    def verify_split(self, root_ids: torch.Tensor, root_pos: torch.Tensor, drafts: DraftBatch,
                     ctx_len: int, plain_ctx_len: int, aux_layers: tuple[int, ...] = ()
                     ) -> tuple[tuple[torch.Tensor, HiddenStates], tuple[torch.Tensor,
                                                                         HiddenStates]]:
        """verify() for the first T = drafts' rows beside a plain decode step for the rest of
        root_ids / root_pos [B] (rows T..B-1), in ONE forward whose linears see only real
        tokens (models.GroupedAttn) -> ((logits [T, 1 + N, V], hidden [T, 1 + N, H]),
        (logits [B - T, V], hidden [B - T, 1, H])). plain_ctx_len: a context bucket above the
        plain rows' positions."""
        num_tree = drafts.tokens.shape[0]
        ids, pos, attn = _tree_inputs(root_ids[:num_tree], root_pos[:num_tree], drafts, ctx_len)
        plain_pos = root_pos[num_tree:].unsqueeze(1)
        num_plain = plain_pos.shape[0]
        plain_attn = causal_cache_meta(plain_pos, plain_ctx_len)
        groups = GroupedAttn((RowGroup(num_tree, ids.shape[1],
                                       self.kv(0, attn, tree=self._own_cells(drafts)), attn),
                              RowGroup(num_plain, 1, self.kv(num_tree, plain_attn, decode=True),
                                       plain_attn)))
        packed_ids = torch.cat([ids.flatten(), root_ids[num_tree:]]).unsqueeze(0)
        packed_pos = torch.cat([pos.flatten(), plain_pos.flatten()]).unsqueeze(0)
        logits, hidden = self.forward(packed_ids, packed_pos, None, groups,
                                      aux_layers=aux_layers)
        split = [ids.numel(), num_plain]
        tree_logits, plain_logits = logits[0].split(split)
        parts = [t[0].split(split) for t in (hidden.final, *hidden.aux)]
        tree_hidden = HiddenStates(parts[0][0].view(*ids.shape, -1),
                                   tuple(p[0].view(*ids.shape, -1) for p in parts[1:]))
        plain_hidden = HiddenStates(parts[0][1].unsqueeze(1),
                                    tuple(p[1].unsqueeze(1) for p in parts[1:]))
        return ((tree_logits.view(*ids.shape, -1), tree_hidden), (plain_logits, plain_hidden))

    def compact(self, root_pos: torch.Tensor, accepted: AcceptedBatch) -> None:
        """Moves the accepted nodes' K/V from their tree cells to their sequence positions
        (cell root_pos + 1 + j for the j-th path node); past the path a copy is a no-op."""
        batch, depth = accepted.path.shape
        if not depth:
            return
        j = torch.arange(depth, device=root_pos.device)
        dst = root_pos.unsqueeze(1) + 1 + j
        src = torch.where(j < accepted.num_accepted.unsqueeze(1),
                          root_pos.unsqueeze(1) + 1 + accepted.path.clamp_min(0), dst)
        if self.pages is not None:
            (dst_block, dst_at), (src_block, src_at) = (
                self.pages.cells(self.pages.table[:batch], c) for c in (dst, src))
            self.kv_cache[:, :, dst_block, dst_at] = self.kv_cache[:, :, src_block, src_at]
            return
        rows = torch.arange(batch, device=root_pos.device).unsqueeze(1).expand(-1, depth)
        kv = self.kv_cache[:, :, :batch]
        kv[:, :, rows, :, dst] = kv[:, :, rows, :, src]

    def move(self, moves: list[SlotMove]) -> None:
        if self.pages is not None:
            self.pages.move(moves)
        else:
            move_slots(self.kv_cache, moves, slot_dim=2, cell_dim=4)

    def _admit(self, share: SharedPrefill, slot_start: int) -> list[int]:
        """Paged: blocks for a prefill batch's rows -> each distinct prompt's first row."""
        assert self.pages is not None
        firsts: list[int] = []
        for row, source in enumerate(share.source):
            slot = slot_start + row
            if source == len(firsts):
                firsts.append(slot)
                self.pages.admit(slot, share.prompts[source])
            else:
                self.pages.fork(slot, firsts[source])
        return firsts

    def _own_cells(self, drafts: DraftBatch) -> torch.Tensor | None:
        """What each of a verify step's [root, nodes] sees of the step's own cells, [B, 1 + N,
        1 + N] (everyone the root, a node its ancestors and itself): the paged kernel's
        new_mask. None without the kernel."""
        if self.paged_attention is None:
            return None
        batch = drafts.tokens.shape[0]
        root = torch.ones(batch, 1 + drafts.width, 1, dtype=torch.bool,
                          device=drafts.tokens.device)
        nodes = torch.cat([torch.zeros_like(drafts.ancestors[:, :1]), drafts.ancestors], 1)
        return torch.cat([root, nodes], 2)


def _tree_inputs(root_ids: torch.Tensor, root_pos: torch.Tensor, drafts: DraftBatch,
                 ctx_len: int) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
    """Token ids and positions [B, 1 + N] of [root, tree nodes] per row, and their attention."""
    batch, num = drafts.tokens.shape
    ids = torch.cat([root_ids.unsqueeze(1), drafts.tokens], 1)
    root = root_pos.unsqueeze(1)
    pos = torch.cat([root, root + drafts.depths], 1)
    cells = root + torch.arange(1 + num, device=root.device)
    sees_tree = torch.cat([torch.zeros(batch, 1, num, dtype=torch.bool, device=root.device),
                           drafts.ancestors], 1)                                 # [B, 1 + N, N]
    return ids, pos, AttnMeta(tree_mask(root_pos, sees_tree, ctx_len), cache_positions=cells)


def paged_attention_of(name: str, block_size: int, head_dim: int
                       ) -> Callable[..., torch.Tensor] | None:
    """The paged attention of decode and verify steps `name` names (None: the gather), or a
    FastdraftError that says what to change."""
    if name == "gather":
        return None
    if name != "triton":
        raise FastdraftError(f"paged_attention must be 'gather' or 'triton', got {name!r}")
    if not block_size:
        raise FastdraftError("paged_attention='triton' reads a paged KV cache: set kv_block_size")
    for what, size in (("kv_block_size", block_size), ("the model's head_dim", head_dim)):
        if size & (size - 1):
            raise FastdraftError(f"paged_attention='triton' needs {what} a power of two, got "
                                 f"{size}")
    try:
        from fastdraft.kernels.triton_paged_attention import paged_attention_triton
    except ImportError as err:
        raise FastdraftError("paged_attention='triton' needs triton installed (pip install "
                             f"triton): {err}") from None
    return paged_attention_triton
