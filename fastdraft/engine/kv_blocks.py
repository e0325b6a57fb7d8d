"""The bookkeeping of a paged KV cache: which fixed-size blocks of cells each request holds, with
the prompt blocks of a GRPO group shared. No tensors here: the cache that stores K/V in these
blocks reads a request's cells through its BlockTable and performs the BlockCopy list the pool
hands back before a write.

- A request's cells 0..n-1 live in its table's blocks, cell c in block c // block_size at
  offset c % block_size.
- Sharing: the blocks of a prompt are indexed by content (block i by the block before it and its
  own tokens, so equal keys mean equal prefixes): a request whose prompt starts as a live
  request's did takes those blocks by reference instead of new ones, the partly filled last
  block too, and the shared cells are prefilled once.
- Copy on write: a step that writes into a block another request also holds first gets a copy
  of it (`BlockCopy`: the cells written so far), so a request never sees another's answer.
- A block whose last holder releases it goes back to the free list and out of the index (the
  sharing is among live requests: a group admitted together)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastdraft.errors import FastdraftError


@dataclass(frozen=True)
class BlockCopy:
    """Before a write: cells [0, num_cells) of block src into block dst."""

    src: int
    dst: int
    num_cells: int


@dataclass
class BlockTable:
    """One request's blocks, in cell order, and how many of its cells hold K/V."""

    blocks: list[int] = field(default_factory=list)
    num_cells: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not (isinstance(num_blocks, int) and num_blocks >= 1):
            raise FastdraftError("BlockPool: num_blocks must be an integer >= 1, got "
                                 f"{num_blocks!r}")
        if not (isinstance(block_size, int) and block_size >= 1):
            raise FastdraftError("BlockPool: block_size must be an integer >= 1, got "
                                 f"{block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}   # (previous block, tokens)
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}     # block -> its index key

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_cells: int) -> int:
        return -(-num_cells // self.block_size)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def admit(self, prompt: Sequence[int], reserve_cells: int = 0,
              share: bool = True) -> BlockTable | None:
        """A new request's table holding its prompt's cells: blocks a live request with the same
        prompt start holds are shared, the rest taken from the free list. None (nothing taken)
        when the free blocks do not cover the new ones plus `reserve_cells` more cells (room
        to decode: admission that leaves none preempts at once). share=False: new blocks,
        not indexed (a caller that shares by fork)."""
        size, found, previous = self.block_size, [], -1
        for begin in range(0, len(prompt) if share else 0, size):
            block = self._index.get((previous, tuple(prompt[begin: begin + size])))
            if block is None:
                break
            found.append(block)
            previous = block
        new = self.blocks_for(len(prompt)) - len(found)
        if new + self.blocks_for(reserve_cells) > len(self._free):
            return None
        table = BlockTable(list(found), len(prompt))
        for block in found:
            self._refs[block] += 1
        for begin in range(len(found) * size, len(prompt), size):
            block = self._take()
            if share:
                key = (previous, tuple(prompt[begin: begin + size]))
                self._index[key], self._key[block] = block, key
            table.blocks.append(block)
            previous = block
        return table

    def fork(self, table: BlockTable) -> BlockTable:
        """A second request with the same cells (a GRPO group's next sample of a prompt just
        prefilled): every block by reference, copied on its first write."""
        for block in table.blocks:
            self._refs[block] += 1
        return BlockTable(list(table.blocks), table.num_cells)

    def shared_cells(self, table: BlockTable) -> int:
        """How many leading cells of a just-admitted table another request already holds (its
        prefill can start there)."""
        shared = 0
        for block in table.blocks:
            if self._refs[block] < 2:
                break
            shared += self.block_size
        return min(shared, table.num_cells)

    def prepare_write(self, table: BlockTable, end: int) -> list[BlockCopy] | None:
        """Cells [table.num_cells, end) are about to be written (a decode step, a draft tree's
        cells): blocks are added up to cell end - 1, and a shared block among those written
        is swapped for a private copy. Returns the copies to make first; None (the table
        unchanged) when the free blocks do not cover it: the caller preempts someone."""
        start = table.num_cells
        if end <= start:
            return []
        if self.blocks_to_write(table, end) > len(self._free):
            return None
        first, last = start // self.block_size, (end - 1) // self.block_size
        grow = last + 1 - len(table.blocks)
        out = []
        for i in range(first, min(last + 1, len(table.blocks))):
            block = table.blocks[i]
            if self._refs[block] > 1:   # copy on write
                mine = self._take()
                out.append(BlockCopy(block, mine, start - i * self.block_size
                                     if i == first else self.block_size))
                self._refs[block] -= 1
                table.blocks[i] = block = mine
            self._unindex(block)   # its content changes: no longer the prompt's
        for _ in range(max(grow, 0)):
            table.blocks.append(self._take())
        table.num_cells = end
        return out

    def blocks_to_write(self, table: BlockTable, end: int) -> int:
        """Free blocks prepare_write(table, end) takes: new ones past the table's end and
        private copies of the shared ones it writes into."""
        start = table.num_cells
        if end <= start:
            return 0
        first, last = start // self.block_size, (end - 1) // self.block_size
        copies = sum(1 for b in table.blocks[first: last + 1] if self._refs[b] > 1)
        return copies + max(last + 1 - len(table.blocks), 0)

    def truncate(self, table: BlockTable, num_cells: int) -> None:
        """The table holds only cells [0, num_cells) (a draft tree's rejected cells): blocks past
        them are released."""
        keep = self.blocks_for(num_cells)
        for block in table.blocks[keep:]:
            self._release(block)
        del table.blocks[keep:]
        table.num_cells = min(table.num_cells, num_cells)

    def release(self, table: BlockTable) -> None:
        """A finished or preempted request's blocks: each goes back to the free list once its
        last holder let it go."""
        for block in table.blocks:
            self._release(block)
        table.blocks, table.num_cells = [], 0

    def _take(self) -> int:
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._unindex(block)
            self._free.append(block)

    def _unindex(self, block: int) -> None:
        key = self._key.pop(block, None)
        if key is not None:
            del self._index[key]
