"""The policy's KV cache in fixed-size blocks (engine/kv_blocks.py keeps the books): one tensor
pool [layers, 2, num_blocks + 1, block_size, kv_heads, head_dim] and a block table per slot
[num_slots, max_blocks] on the device, in static buffers (captured graphs read them in place).

Slots stay what the scheduler and the per-slot state (sampling settings, the drafter's cache)
index by, but a slot holds no K/V of its own: its table row names the blocks of its request.
Moving a request to another slot moves a table row, not its K/V; a finished request gives its
blocks back; a GRPO group's rows point at the same prompt blocks (the prompt is computed once).
The last block is a sink: every table entry no request owns points at it, so the writes nobody
reads (padding rows of a bucket, a prefill's padding past a row's blocks) land there and never
in another request's block."""

from __future__ import annotations

import torch

from fastdraft.engine.kv_blocks import BlockPool, BlockTable
from fastdraft.engine.scheduler import SlotMove
from fastdraft.errors import FastdraftError
from fastdraft.models import ModelConfig

# Cells per block (KV_BLOCK_SIZE, config/engine.py): vLLM's and SGLang's default page sizes
# are 16 and 1; 16 keeps a table row short (cache_len / 16 entries to gather) while a request
# wastes under 16 cells at its end.


def kv_blocks_in(gigabytes: float | None, cfg: ModelConfig, dtype: torch.dtype,
                 block_size: int) -> int | None:
    """Blocks of a paged cache of `gigabytes` decimal GB (None: None, the default size)."""
    if gigabytes is None or not block_size:
        return None
    cell = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    return max(int(gigabytes * 1e9) // (block_size * cell) - 1, 1)   # the sink is one more


def check_kv_blocks(num_blocks: int, cache_len: int, block_size: int) -> None:
    """A bounded cache holds one longest sequence and a block to spare, so a request alone
    always runs (what PagedKV and the memory plan both refuse)."""
    longest = -(-cache_len // block_size)
    if num_blocks < longest + 1:
        raise FastdraftError(
            f"the paged KV cache holds {num_blocks} blocks of {block_size} cells, less than one "
            f"longest sequence ({cache_len} cells: max_seq_len and a draft tree's cells) and a "
            f"block to spare; raise rollout.kv_cache_gb to at least {longest + 1} blocks' worth, "
            "or lower rollout.max_seq_len")


class PagedKV:
    def __init__(self, cfg: ModelConfig, num_slots: int, cache_len: int, block_size: int,
                 num_blocks: int | None, dtype: torch.dtype, device: torch.device) -> None:
        """num_blocks None: every slot can hold cache_len cells at once (nothing is ever
        short of blocks, admission goes by free slots alone; sharing then only saves compute
        and copies). Fewer (`bounded`): requests wait for blocks and are preempted when they
        run out; at least one longest sequence and a block to spare must fit, so a request
        alone always runs."""
        if block_size < 1:
            raise FastdraftError(f"the KV block size must be >= 1 cell, got {block_size}")
        self.block_size = block_size
        self.max_blocks = -(-cache_len // block_size)
        self.bounded = num_blocks is not None
        self.num_blocks = num_blocks if num_blocks is not None else num_slots * self.max_blocks
        if self.bounded:
            check_kv_blocks(self.num_blocks, cache_len, block_size)
        self.sink = self.num_blocks
        self.kv = torch.zeros(cfg.num_hidden_layers, 2, self.num_blocks + 1, block_size,
                              cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
        self.table = torch.full((num_slots, self.max_blocks), self.sink, dtype=torch.long,
                                device=device)
        self.reset()

    def reset(self) -> None:
        """Every block free, every slot empty (a generate call starts from here)."""
        self.pool = BlockPool(self.num_blocks, self.block_size)
        self.slots: list[BlockTable | None] = [None] * self.table.shape[0]
        self.table.fill_(self.sink)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_cells: int) -> int:
        return self.pool.blocks_for(num_cells)

    def blocks_to_write(self, ends: list[int]) -> int:
        """Free blocks reserve(ends) would take."""
        return sum(self.pool.blocks_to_write(self.slots[slot], end)
                   for slot, end in enumerate(ends))

    def admit(self, slot: int, tokens: list[int]) -> None:
        """Slot takes new blocks for its prefill's cells (a group's equal prompts: fork).
        Whatever the slot still held (a caller that drove steps without finishing its
        requests, e.g. a bench) is given back first."""
        self.release([slot])
        table = self.pool.admit(tokens, share=False)
        if table is None:
            raise KVPoolFull(f"no free KV blocks for a {len(tokens)}-token prefill "
                             f"({self.num_free} of {self.num_blocks} free)")
        self.slots[slot] = table
        self._sync([slot])

    def fork(self, slot: int, source: int) -> None:
        """Slot holds the same cells as slot `source` (its prompt's other sample), by reference."""
        table = self.slots[source]
        assert table is not None, f"slot {source} holds no request"
        self.release([slot])
        self.slots[slot] = self.pool.fork(table)
        self._sync([slot])

    def reserve(self, ends: list[int]) -> None:
        """Slots 0..len(ends)-1 are about to write cells up to ends[slot] - 1 (a decode token, a
        draft tree's cells): their tables grow, and a block they share is copied first."""
        changed, copies = [], []
        for slot, end in enumerate(ends):
            table = self.slots[slot]
            assert table is not None, f"slot {slot} holds no request"
            num_blocks = len(table.blocks)
            made = self.pool.prepare_write(table, end)
            if made is None:
                raise KVPoolFull(f"no free KV blocks to write cells up to {end} of slot "
                                 f"{slot} ({self.num_free} of {self.num_blocks} free)")
            copies += made
            if made or len(table.blocks) != num_blocks:
                changed.append(slot)
        if copies:   # whole blocks: the cells past num_cells are junk nobody reads
            src = torch.tensor([c.src for c in copies], device=self.kv.device)
            dst = torch.tensor([c.dst for c in copies], device=self.kv.device)
            self.kv[:, :, dst] = self.kv[:, :, src]
        self._sync(changed)

    def trim(self, num_cells: dict[int, int]) -> None:
        """Slot -> the cells it keeps (its committed ones; a tree's rejected cells past them
        give their blocks back)."""
        changed = []
        for slot, cells in num_cells.items():
            table = self.slots[slot]
            if table is not None and self.pool.blocks_for(cells) < len(table.blocks):
                changed.append(slot)
            if table is not None:
                self.pool.truncate(table, cells)
        self._sync(changed)

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            table = self.slots[slot]
            if table is not None:
                self.pool.release(table)
            self.slots[slot] = None
        self._sync(slots)

    def move(self, moves: list[SlotMove]) -> None:
        """The scheduler's slot moves (compactions and swaps): table rows, not K/V."""
        before = list(self.slots)
        for move in moves:
            self.slots[move.dst] = before[move.src]
        vacated = {m.src for m in moves} - {m.dst for m in moves}
        for slot in vacated:
            self.slots[slot] = None
        self._sync(sorted({m.dst for m in moves} | vacated))

    def span(self, slot: int, num_cells: int) -> int | None:
        """The first block when the slot's blocks holding its first num_cells cells are
        consecutive in the pool (one view reads them), else None."""
        table = self.slots[slot]
        count = self.pool.blocks_for(num_cells)
        if table is None or len(table.blocks) < count:
            return None
        first = table.blocks[0]
        return first if table.blocks[:count] == list(range(first, first + count)) else None

    def cells(self, table: torch.Tensor, cells: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' tables [B, max_blocks], cells [B, T] -> (block, offset) [B, T]."""
        return table.gather(1, cells // self.block_size), cells % self.block_size

    def _sync(self, slots: list[int]) -> None:
        if not slots:
            return
        rows = [self._row(s) for s in slots]
        self.table[torch.tensor(slots, device=self.table.device)] = torch.tensor(
            rows, dtype=torch.long, device=self.table.device)

    def _row(self, slot: int) -> list[int]:
        table = self.slots[slot]
        blocks = table.blocks if table is not None else []
        return blocks + [self.sink] * (self.max_blocks - len(blocks))


class KVPoolFull(RuntimeError):
    """The paged KV pool has no free block for a write (the engine preempts on it)."""
