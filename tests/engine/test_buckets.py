import pytest

from fastdraft.engine.buckets import BucketPlan


def test_graph_ladders_cover_every_size_up_to_the_maximum():
    plan = BucketPlan.build(max_batch_size=96, cache_len=5000)
    assert plan.batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96)
    assert plan.context_lens == (256, 512, 1024, 2048, 4096, 5000)
    assert [plan.batch_bucket(n) for n in (1, 3, 8, 9, 57, 65, 96)] == [1, 4, 8, 16, 64, 96, 96]
    assert [plan.context_bucket(n) for n in (1, 256, 257, 4097)] == [256, 256, 512, 5000]
    with pytest.raises(ValueError, match="exceeds"):
        plan.batch_bucket(97)
    with pytest.raises(ValueError, match="exceeds"):
        plan.context_bucket(5001)


def test_small_engines_and_exact_ladders():
    plan = BucketPlan.build(max_batch_size=3, cache_len=100)
    assert plan.batch_sizes == (1, 2, 3) and plan.context_lens == (100,)
    exact = BucketPlan.build(max_batch_size=5, cache_len=40, exact=True)
    assert [exact.batch_bucket(n) for n in range(1, 6)] == [1, 2, 3, 4, 5]
    assert exact.context_bucket(17) == 17


def test_ladders_are_checked():
    with pytest.raises(ValueError, match="ascending"):
        BucketPlan(batch_sizes=(4, 2), context_lens=(8,))
    with pytest.raises(ValueError, match="ascending"):
        BucketPlan(batch_sizes=(1,), context_lens=())
