"""KV views and the masks every static step builds from device tensors."""

from __future__ import annotations

import torch

from fastdraft.models.attn_meta import KVView, causal_pairs_mask, tree_mask


def test_kv_rows_are_views_of_consecutive_slots() -> None:
    k = [torch.zeros(4, 1, 8, 2)]
    v = [torch.zeros(4, 1, 8, 2)]
    keys, values = KVView(k, v, slot_start=1).rows(0, 2)
    keys[1, 0, 3] = 7.0
    assert k[0][2, 0, 3].tolist() == [7.0, 7.0] and values.shape == (2, 1, 8, 2)


def test_tree_mask_equals_a_per_row_reference() -> None:
    """Row b sees its context (cells first_cell..root_pos[b]) and the tree cells
    root_pos[b] + 1 + m its ancestors allow, whatever the other rows' lengths."""
    for first_cell in (0, 1):
        root_pos = torch.tensor([3, 0, 9])
        anc = torch.rand(3, 4, 5, generator=torch.Generator().manual_seed(1)) < 0.5
        ctx_len = 16
        got = tree_mask(root_pos, anc, ctx_len, first_cell)
        for b in range(3):
            for q in range(4):
                for s in range(ctx_len):
                    rel = s - int(root_pos[b]) - 1
                    want = (first_cell <= s <= root_pos[b]) or (0 <= rel < 5
                                                                  and bool(anc[b, q, rel]))
                    assert bool(got[b, q, s]) == want, (b, q, s)


def test_tree_mask_does_not_depend_on_neighbours() -> None:
    anc = torch.eye(3, dtype=torch.bool).unsqueeze(0)
    alone = tree_mask(torch.tensor([5]), anc, 12)
    together = tree_mask(torch.tensor([5, 1]), anc.expand(2, -1, -1), 12)
    assert torch.equal(alone[0], together[0])


def test_causal_pairs_mask_skips_cell_zero() -> None:
    mask = causal_pairs_mask(torch.tensor([[1, 3]]), 5)
    assert mask[0].tolist() == [[False, True, False, False, False],
                                [False, True, True, True, False]]
