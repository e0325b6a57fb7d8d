"""BlockPool: a GRPO group's prompt takes its blocks once, a write into a shared block copies it
first, blocks come back when their last holder lets go, and refusals change nothing. The
property test runs random admissions, decode and tree writes, truncations and preemptions
against a simulated cache whose cells hold what was written: every live request reads back
exactly its own sequence."""

from __future__ import annotations

import itertools
import random

import pytest

from fastdraft.engine.kv_blocks import BlockCopy, BlockPool, BlockTable


def test_a_group_shares_its_prompt_and_copies_the_partial_block_on_write():
    pool = BlockPool(num_blocks=64, block_size=16)
    prompt = list(range(37))   # 2 full blocks + 5 cells
    tables = [pool.admit(prompt) for _ in range(8)]
    assert pool.num_free == 64 - 3   # the prompt's 3 blocks, once
    assert all(t.blocks == tables[0].blocks for t in tables)
    assert all(pool.shared_cells(t) == 37 for t in tables)
    copies = [pool.prepare_write(t, 38) for t in tables]   # each request's first answer token
    # Seven copy the shared partial block (its 5 prompt cells); the last holder writes in place.
    assert [len(c) for c in copies] == [1] * 7 + [0]
    assert all(c[0].src == tables[7].blocks[2] and c[0].num_cells == 5 for c in copies[:7])
    assert len({t.blocks[2] for t in tables}) == 8 and len({t.blocks[0] for t in tables}) == 1
    assert pool.num_free == 64 - 3 - 7
    for table in tables:
        pool.release(table)
    assert pool.num_free == 64 and all(pool.refs(b) == 0 for b in range(64))


def test_only_an_equal_prefix_is_shared():
    pool = BlockPool(num_blocks=16, block_size=4)
    a = pool.admit([1, 2, 3, 4, 5, 6])
    b = pool.admit([1, 2, 3, 4, 5, 7])    # the same first block, a different partial block
    c = pool.admit([1, 2, 3, 4, 5, 6, 8])  # a's partial block holds 5, 6: not c's 5, 6, 8
    d = pool.admit([9, 2, 3, 4, 5, 6])
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    assert c.blocks[0] == a.blocks[0] and c.blocks[1] not in (a.blocks[1], b.blocks[1])
    assert d.blocks[0] != a.blocks[0]
    assert pool.shared_cells(d) == 0


def test_a_written_block_is_no_longer_offered_as_the_prompt():
    pool = BlockPool(num_blocks=8, block_size=4)
    a = pool.admit([1, 2, 3, 4, 5])
    assert pool.prepare_write(a, 7) == []   # a alone: writes in place
    b = pool.admit([1, 2, 3, 4, 5])
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]


def test_refusals_change_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    a = pool.admit(list(range(10)))   # 3 blocks
    assert pool.admit(list(range(100, 106))) is None   # needs 2, 1 free
    assert pool.admit(list(range(100, 103)), reserve_cells=4) is None   # 1 + 1 reserved
    assert pool.num_free == 1
    b = pool.admit(list(range(10)))   # shares all 3
    before = (list(a.blocks), a.num_cells, list(b.blocks), pool.num_free)
    assert pool.prepare_write(a, 13) is None   # a copy of the shared partial block + 1 new
    assert (list(a.blocks), a.num_cells, list(b.blocks), pool.num_free) == before
    pool.release(b)
    assert pool.prepare_write(a, 13) == [] and pool.num_free == 0


def test_truncate_gives_back_the_blocks_past_the_kept_cells():
    pool = BlockPool(num_blocks=8, block_size=4)
    a = pool.admit([1, 2, 3])
    pool.prepare_write(a, 13)   # a draft tree's cells: 4 blocks
    assert len(a.blocks) == 4 and pool.num_free == 4
    pool.truncate(a, 5)
    assert len(a.blocks) == 2 and a.num_cells == 5 and pool.num_free == 6


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(8, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)


class _Cache:
    """A simulated paged cache: cells hold the token written there."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.cells = [[None] * pool.block_size for _ in range(pool.num_blocks)]

    def copy(self, copies: list[BlockCopy]) -> None:
        for c in copies:
            self.cells[c.dst][: c.num_cells] = self.cells[c.src][: c.num_cells]

    def write(self, table: BlockTable, start: int, tokens: list[int]) -> None:
        for i, token in enumerate(tokens, start):
            self.cells[table.blocks[i // self.pool.block_size]][i % self.pool.block_size] = token

    def read(self, table: BlockTable) -> list[int]:
        size = self.pool.block_size
        return [self.cells[table.blocks[i // size]][i % size] for i in range(table.num_cells)]


@pytest.mark.parametrize("seed", range(6))
def test_every_request_reads_back_its_own_sequence(seed):
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=40, block_size=rng.choice([1, 3, 4, 16]))
    cache = _Cache(pool)
    live: dict[int, tuple[BlockTable, list[int]]] = {}   # request -> (table, its tokens)
    ids = itertools.count()
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    for _ in range(400):
        op = rng.random()
        if op < 0.25:   # a group of one prompt
            prompt = rng.choice(prompts)
            for _ in range(rng.randrange(1, 5)):
                table = pool.admit(prompt, reserve_cells=rng.randrange(4))
                if table is None:
                    break
                shared = pool.shared_cells(table)
                cache.write(table, shared, prompt[shared:])   # the prefill skips shared cells
                live[next(ids)] = (table, list(prompt))
        elif live and op < 0.8:   # a decode step or a draft tree's cells, then the kept ones
            request = rng.choice(list(live))
            table, tokens = live[request]
            width = rng.randrange(1, 9)
            start = table.num_cells
            copies = pool.prepare_write(table, start + width)
            if copies is None:   # out of blocks: preempt it
                pool.release(table)
                del live[request]
                continue
            cache.copy(copies)
            new = [rng.randrange(50) + 100 for _ in range(width)]
            cache.write(table, start, new)
            keep = rng.randrange(1, width + 1)
            pool.truncate(table, start + keep)
            tokens += new[:keep]
        elif live:   # a request finishes
            request = rng.choice(list(live))
            pool.release(live.pop(request)[0])
        for table, tokens in live.values():
            assert cache.read(table) == tokens
        held = sum(len(t.blocks) for t, _ in live.values())
        assert sum(pool.refs(b) for b in range(pool.num_blocks)) == held
        assert pool.num_free == sum(pool.refs(b) == 0 for b in range(pool.num_blocks))
    for table, _ in live.values():
        pool.release(table)
    assert pool.num_free == pool.num_blocks
