"""Counter-based uniforms: uniform, reproducible, keyed by (seed, site, counter) only."""

import torch
from scipy import stats

from fastdraft.engine.rng import Stream, draft_counter, mix64, seed_of, uniform


def test_uniforms_are_uniform_and_in_the_open_interval():
    u = uniform(torch.tensor([7]), torch.arange(200_000).view(1, -1), Stream.SAMPLE)[0]
    assert u.dtype == torch.float64 and float(u.min()) > 0 and float(u.max()) < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    # consecutive draws are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


def test_a_draw_depends_on_its_own_seed_site_and_counter_only():
    seeds = torch.tensor([1, 2, 1, (1 << 40) + 1])
    counters = torch.tensor([[5, 6], [5, 6], [5, 6], [5, 6]])
    u = uniform(seeds, counters, Stream.VERIFY)
    assert torch.equal(u[0], u[2])                       # same seed and counter: same value
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[3])  # high seed bits count
    alone = uniform(seeds[:1], counters[:1], Stream.VERIFY)
    assert torch.equal(alone[0], u[0])                   # whatever the batch around it
    assert not torch.equal(uniform(seeds[:1], counters[:1], Stream.BONUS)[0], u[0])
    big = torch.tensor([[(1 << 45) + 5]])                # counters above 32 bits still count
    assert not torch.equal(uniform(seeds[:1], big, Stream.VERIFY), u[:1, :1])


def test_draft_counters_do_not_collide_across_levels_and_positions():
    idx = torch.arange(4 * 64).view(4, 64)
    counters = {int(c) for pos in (0, 1, 1000) for level in range(8)
                for c in draft_counter(torch.tensor(pos), level, idx).flatten()}
    assert len(counters) == 3 * 8 * 4 * 64


def test_seeds_of_a_call():
    assert seed_of(10, 3) == 13
    gen = torch.Generator().manual_seed(0)
    assert seed_of(None, 0, gen) != seed_of(None, 0, gen)


def _mix64_exact(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_the_hash_is_splitmix64_bit_for_bit():
    """int64 products must wrap modulo 2^64 on this device for the streams to be what they
    claim: compare with exact Python integers."""
    values = [0, 1, 12345, (1 << 62) + 7, -5, -(1 << 63)]
    got = mix64(torch.tensor(values, dtype=torch.long)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_mix64_exact(v) for v in values]
