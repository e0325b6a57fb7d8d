import torch

from fastdraft.models.attn_meta import KVViews


def test_kv_views_reuses_the_view_while_the_batch_is_unchanged() -> None:
    k = [torch.zeros(4, 1, 8, 2)]
    v = [torch.zeros(4, 1, 8, 2)]
    views = KVViews(k, v)
    first = views([1, 2])
    assert views([1, 2]) is first
    assert first.slot_start == 1 and first.slot_ids.tolist() == [1, 2]
    other = views([3, 0])
    assert other is not first
    assert other.slot_start is None and other.slot_ids.tolist() == [3, 0]
    assert views([1, 2]).slot_ids.tolist() == [1, 2]
