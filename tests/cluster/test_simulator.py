"""The cluster simulator (fastdraft/cluster/simulator.py): hand-computed step times, what each
dispatch policy and mode is for, validation, the bench-payload and shape-file readers, and
determinism. Tiny cases with round numbers, so every expected value can be checked by hand."""

from __future__ import annotations

import math

import pytest

from fastdraft.cluster.dispatch import assign_groups
from fastdraft.cluster.simulator import (
    DEFAULT_ACCEPT,
    MODES,
    SimConfig,
    StepShape,
    UnitCosts,
    load_shapes,
    long_tail_lengths,
    projections,
    save_shapes,
    simulate_run,
    simulate_step,
    summarize,
    timeline_spans,
)
from fastdraft.errors import FastdraftError

# One second an engine step whatever the batch, no drafter cost: step counts read as seconds.
UNIT = UnitCosts(step_base_s=1.0, step_row_s=0.0, verify_factor=1.0, draft_level_s=0.0)


def spans_of(result, worker):
    return [(s.state, s.start_s, s.end_s) for s in result.spans if s.worker == worker]


def test_plain_one_worker_matches_hand_computed_step_time():
    costs = UnitCosts(step_base_s=1.0, step_row_s=0.5, prefill_token_s=0.1, update_s=1.0,
                      push_s=0.5)
    shape = StepShape(lengths=(2, 4), group_size=2, prompt_tokens=2)
    # Both admitted at once: prefill 2 * 2 * 0.1 = 0.4; 2 steps at 2 rows (2.0 s each) -> 4.4;
    # 2 more at 1 row (1.5 s each) -> 7.4; then update and push.
    result = simulate_step(shape, costs, SimConfig(workers=1), "plain")
    assert result.rollout_s == pytest.approx(7.4)
    assert result.step_s == pytest.approx(8.9)
    assert result.idle_fraction == 0.0 and result.train_s == 0.0 and result.migrated == 0
    assert spans_of(result, 0) == [("generate", 0.0, pytest.approx(7.4))]
    # One row at a time: 0.2 + 2 * 1.5 = 3.2, then the queued one: 3.2 + 0.2 + 4 * 1.5.
    serial = simulate_step(shape, costs, SimConfig(workers=1, max_batch=1), "plain")
    assert serial.rollout_s == pytest.approx(9.4)


def test_balance_beats_round_robin_on_a_skewed_step():
    shape = StepShape(lengths=(100, 1, 100, 1), group_size=1)
    rr = simulate_step(shape, UNIT, SimConfig(workers=2, max_batch=1, dispatch="round_robin"),
                       "plain")
    balance = simulate_step(shape, UNIT, SimConfig(workers=2, max_batch=1), "plain")
    assert rr.rollout_s == pytest.approx(200.0)  # both long groups on worker 0
    assert balance.rollout_s == pytest.approx(101.0)


def test_dispatch_rules_the_simulator_uses():
    # The pool's dispatch (fastdraft/cluster/dispatch.py), as the simulator relies on it: the
    # worker of each group.
    costs = [5.0, 9.0, 1.0, 7.0, 3.0]
    assert assign_groups(costs, 3, "round_robin") == [0, 1, 2, 0, 1]
    # Longest first onto the least loaded: 9 -> w0, 7 -> w1, 5 -> w2, 3 -> w2 (5), 1 -> w1 (7).
    assert assign_groups(costs, 3, "balance") == [2, 0, 1, 1, 2]
    # ceil(5 / 3) = 2 groups a worker, longest first: the remainder leaves the last one short.
    assert assign_groups(costs, 3, "concentrate") == [1, 0, 2, 0, 1]
    assert assign_groups([1.0, 1.0], 4, "concentrate") == [0, 1]


def test_concentrate_frees_the_short_workers_early():
    # Eight groups of two equal answers, 800 down to 100 tokens: a worker's time is its longest.
    lengths = tuple(n for n in range(800, 0, -100) for _ in range(2))
    shape = StepShape(lengths=lengths, group_size=2)
    runs = {d: simulate_step(shape, UNIT, SimConfig(workers=4, dispatch=d), "plain")
            for d in ("balance", "concentrate")}
    assert runs["balance"].rollout_s == runs["concentrate"].rollout_s == pytest.approx(800.0)
    # balance: workers end at 800/700/600/500; concentrate: 800/600/400/200.
    assert spans_of(runs["concentrate"], 3) == [("generate", 0.0, 200.0),
                                                ("idle", 200.0, 800.0)]
    assert spans_of(runs["balance"], 3)[-1] == ("idle", 500.0, 800.0)
    assert runs["concentrate"].idle_fraction == pytest.approx(1200 / 3200)
    assert runs["balance"].idle_fraction == pytest.approx(600 / 3200)


def test_speculation_divides_decode_time_by_accept_over_verify_cost():
    costs = UnitCosts(step_base_s=0.02, step_row_s=0.0)  # decode-bound: verify 1.11 steps
    shape = StepShape(lengths=(1000,) * 4, group_size=4)
    cfg = SimConfig(workers=1)
    plain = simulate_step(shape, costs, cfg, "plain")
    spec = simulate_step(shape, costs, cfg, "spec_fixed", accept_length=2.0)
    assert plain.rollout_s / spec.rollout_s == pytest.approx(2.0 / 1.11)
    assert spec.accept_length == 2.0 and plain.accept_length == 1.0
    # Drafter levels add to every verify step: 500 steps of 0.02 * 1.11 + 3 * 0.01.
    drafted = UnitCosts(step_base_s=0.02, step_row_s=0.0, draft_level_s=0.01)
    assert simulate_step(shape, drafted, cfg, "spec_fixed", 2.0).rollout_s == pytest.approx(
        500 * (0.02 * 1.11 + 0.03))
    # Fractional accept lengths accumulate: 10 tokens at 3 a step need 4 steps, at 2.5 too.
    ten = StepShape(lengths=(10,), group_size=1)
    assert simulate_step(ten, UNIT, cfg, "spec_fixed", 3.0).rollout_s == 4.0
    assert simulate_step(ten, UNIT, cfg, "spec_fixed", 2.5).rollout_s == 4.0


def test_spot_training_refreshes_only_when_idle_seconds_suffice():
    # Worker 1 finishes 90 s before worker 0 every step: 90 idle worker-seconds to train on.
    shapes = [StepShape(lengths=(100, 10), group_size=1)] * 3
    for need, staleness, refreshed in ((90.0, [0, 0, 0], [True] * 3),
                                       (91.0, [0, 1, 2], [False] * 3)):
        cfg = SimConfig(workers=2, train_s_per_refresh=need)
        runs = simulate_run(shapes, UNIT, cfg, lambda s: 1.0, modes=("spec_spot", "spec_fixed"))
        assert [r.train_s for r in runs["spec_spot"]] == [90.0] * 3
        assert [r.staleness for r in runs["spec_spot"]] == staleness
        assert [r.refreshed for r in runs["spec_spot"]] == refreshed
        assert [r.staleness for r in runs["spec_fixed"]] == [0, 1, 2]  # trained once
        assert all(r.train_s == 0.0 for r in runs["spec_fixed"])  # its idle time is wasted
        assert spans_of(runs["spec_spot"][0], 1)[-1] == ("train", 10.0, 100.0)
    # A table: the largest key <= the staleness, clamped at both ends.
    runs = simulate_run(shapes, UNIT, SimConfig(workers=2), {1: 2.0, 3: 1.0},
                        modes=("spec_fixed",))
    assert [r.accept_length for r in runs["spec_fixed"]] == [2.0, 2.0, 2.0]
    runs = simulate_run(shapes * 2, UNIT, SimConfig(workers=2), {0: 2.0, 3: 1.0},
                        modes=("spec_fixed",))
    assert [r.accept_length for r in runs["spec_fixed"]] == [2.0, 2.0, 2.0, 1.0, 1.0, 1.0]


def test_consolidation_hands_the_tail_off_at_the_receivers_next_step():
    costs = UnitCosts(step_base_s=1.0, step_row_s=0.0, verify_factor=1.0, prefill_token_s=0.01)
    # round_robin: worker 0 runs (50, 3), worker 1 runs (40, 5); prompts of 10 tokens.
    shape = StepShape(lengths=(50, 40, 3, 5), group_size=1, prompt_tokens=10)
    cfg = SimConfig(workers=2, dispatch="round_robin", consolidate_below=2)
    spot = simulate_step(shape, costs, cfg, "spec_spot")
    result = simulate_step(shape, costs, cfg, "spec_consolidated")
    # Worker 0 is down to one row at 0.2 + 3 = 3.2 and hands it (3 tokens generated) to
    # worker 1, whose third step ends then; re-prefill (10 + 3) * 0.01; 47 steps remain.
    assert result.migrated == 1
    assert spans_of(result, 0) == [("generate", 0.0, pytest.approx(3.2)),
                                   ("train", pytest.approx(3.2), pytest.approx(50.33))]
    assert result.rollout_s == pytest.approx(3.2 + 0.13 + 47)
    assert spot.rollout_s == pytest.approx(50.2) and spot.migrated == 0
    assert result.train_s > 4 * spot.train_s  # the donor trains from 3.2 instead of 50.2
    # A tail never queues behind a full batch: at 3.2 worker 1 has no room for a third row,
    # so worker 0 keeps its tail; at 5.2 worker 1 is down to one row, and it goes the other way
    # (5 tokens generated: re-prefill 0.15, then 45 steps of the longer request).
    full = simulate_step(shape, costs, SimConfig(workers=2, max_batch=2, dispatch="round_robin",
                                                 consolidate_below=2), "spec_consolidated")
    assert full.migrated == 1
    assert spans_of(full, 1) == [("generate", 0.0, pytest.approx(5.2)),
                                 ("train", pytest.approx(5.2), pytest.approx(50.35))]


def test_consolidation_frees_workers_on_a_long_tail():
    shape = StepShape(lengths=tuple(long_tail_lengths(8 * 32, 8, 300.0, 5.0, 4000, seed=1)),
                      group_size=8, prompt_tokens=64)
    costs = UnitCosts(step_base_s=0.02, step_row_s=1e-4, prefill_token_s=1e-6)
    cfg = SimConfig(workers=8, consolidate_below=4)
    spot = simulate_step(shape, costs, cfg, "spec_spot", 2.0)
    result = simulate_step(shape, costs, cfg, "spec_consolidated", 2.0)
    assert result.migrated > 0
    assert result.train_s > 1.2 * spot.train_s
    assert result.idle_fraction > spot.idle_fraction


def test_consolidation_never_migrates_with_one_worker_generating():
    shape = StepShape(lengths=(40, 3, 5, 7), group_size=4)
    for workers in (1, 3):  # one group: with 3 workers two have nothing to generate
        cfg = SimConfig(workers=workers, consolidate_below=100)
        result = simulate_step(shape, UNIT, cfg, "spec_consolidated", 2.0)
        assert result.migrated == 0
        assert result.rollout_s == simulate_step(shape, UNIT, cfg, "spec_spot", 2.0).rollout_s


@pytest.mark.parametrize("make, field", [
    (lambda: UnitCosts(step_base_s=-1.0, step_row_s=0.0), "step_base_s"),
    (lambda: UnitCosts(step_base_s=1.0, step_row_s=math.nan), "step_row_s"),
    (lambda: UnitCosts(step_base_s=1.0, step_row_s=0.0, draft_levels=2.5), "draft_levels"),
    (lambda: SimConfig(workers=0), "workers"),
    (lambda: SimConfig(workers=1, dispatch="random"), "dispatch"),
    (lambda: SimConfig(workers=1, train_s_per_refresh=-1.0), "train_s_per_refresh"),
    (lambda: StepShape(lengths=(1, 2, 3), group_size=2), "group_size"),
    (lambda: StepShape(lengths=(0, 2), group_size=2), "lengths"),
    (lambda: StepShape(lengths=(1, 2), group_size=2, predicted=(1,)), "predicted"),
    (lambda: simulate_step(StepShape((1,), 1), UNIT, SimConfig(workers=1),
                           "spec_consolidated"), "consolidate_below"),
    (lambda: simulate_step(StepShape((1,), 1), UNIT, SimConfig(workers=1), "spec_spot", 0.5),
     "accept_length"),
    (lambda: simulate_step(StepShape((1,), 1), UNIT, SimConfig(workers=1), "fast"), "mode"),
    (lambda: simulate_run([StepShape((1,), 1)], UNIT, SimConfig(workers=1), None),
     "accept_by_staleness"),
])
def test_validation_is_one_clear_value_error(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_plain_alone_needs_no_accept_table():
    runs = simulate_run([StepShape((3,), 1)], UNIT, SimConfig(workers=1), None, modes=("plain",))
    assert runs["plain"][0].rollout_s == 3.0


def test_load_shapes_round_trip(tmp_path):
    shapes = [StepShape((5, 7, 9, 11), 2, prompt_tokens=12),
              StepShape([3, 4], 2, predicted=[2, 8])]  # lists are stored as tuples
    path = tmp_path / "shapes.jsonl"
    save_shapes(shapes, path)
    assert load_shapes(path) == shapes
    path.write_text(path.read_text() + '\n{"step": 2, "group_size": 2, "lengths": [1]}\n')
    with pytest.raises(ValueError, match=r"shapes.jsonl:4"):
        load_shapes(path)


def bench_payload():
    """A `fastdraft bench gpu --json` payload's parts that matter, keys as gpu_bench writes
    them: the best decode variant is 10 ms + 0.1 ms a row at both contexts."""
    decode = [dict(batch_size=b, context=ctx, eager_ms=30 + b, graphs_ms=20 + b,
                   compiled_graphs_ms=10 + 0.1 * b, roofline_ms=5.0)
              for b in (1, 8, 64) for ctx in (512, 4096)]
    cycle = [dict(draft_vocab=vocab, mode=mode, decode_ms=10.0, draft_tree_ms=tree,
                  verify_ms=verify, commit_ms=1.0, cycle_ms=tree + verify + 1.0)
             for vocab, tree, verify in ((151936, 9.0, 14.0), (32768, 6.0, 12.0))
             for mode in ("greedy", "sampled")]
    return dict(shape="qwen2.5-7b", decode=decode, cycle=cycle)


def test_from_gpu_bench_reads_the_real_keys():
    costs = UnitCosts.from_gpu_bench(bench_payload(), update_s=5.0)
    assert costs.step_base_s == pytest.approx(0.010)
    assert costs.step_row_s == pytest.approx(0.0001)
    # The sampled row with the 32k draft vocabulary: (12 + 1) / 10; its 6 ms tree over depth 6.
    assert costs.verify_factor == pytest.approx(1.3)
    assert costs.draft_levels == 6 and costs.draft_level_s == pytest.approx(0.001)
    assert costs.update_s == 5.0
    no_cycle = {k: v for k, v in bench_payload().items() if k != "cycle"}
    assert UnitCosts.from_gpu_bench(no_cycle).verify_factor == 1.11  # the default
    broken = bench_payload()
    del broken["decode"][2]["batch_size"]
    with pytest.raises(ValueError, match="batch_size"):
        UnitCosts.from_gpu_bench(broken)
    broken = bench_payload()
    del broken["cycle"][3]["commit_ms"]
    with pytest.raises(ValueError, match="commit_ms"):
        UnitCosts.from_gpu_bench(broken)
    with pytest.raises(ValueError, match="'decode'"):
        UnitCosts.from_gpu_bench({"cycle": bench_payload()["cycle"]})


def test_fit_is_least_squares_clamped_at_zero():
    fitted = UnitCosts.fit([1, 2, 4], [0.012, 0.014, 0.018])
    assert fitted.step_base_s == pytest.approx(0.010)
    assert fitted.step_row_s == pytest.approx(0.002)
    falling = UnitCosts.fit([1, 3], [0.02, 0.01])  # noise: a step does not get cheaper
    assert falling.step_row_s == 0.0 and falling.step_base_s == pytest.approx(0.015)
    with pytest.raises(ValueError, match="distinct"):
        UnitCosts.fit([8, 8], [0.1, 0.2])


def test_same_inputs_same_outputs():
    assert long_tail_lengths(64, 8, 500.0, 4.0, 8000, seed=3) == \
        long_tail_lengths(64, 8, 500.0, 4.0, 8000, seed=3)
    assert long_tail_lengths(64, 8, 500.0, 4.0, 8000, seed=3) != \
        long_tail_lengths(64, 8, 500.0, 4.0, 8000, seed=4)
    shapes = [StepShape(long_tail_lengths(96, 8, 400.0, 5.0, 6000, seed=s), 8, 32)
              for s in range(3)]
    costs = UnitCosts(step_base_s=0.02, step_row_s=1e-4, prefill_token_s=1e-6, update_s=2.0)
    cfg = SimConfig(workers=4, consolidate_below=3, train_s_per_refresh=5.0)
    table = {0: 3.0, 1: 2.5, 3: 2.0}
    assert simulate_run(shapes, costs, cfg, table) == simulate_run(shapes, costs, cfg, table)


def test_long_tail_lengths_follow_the_asked_law():
    lengths = long_tail_lengths(4096, 16, 1500.0, 5.0, 100_000, seed=0)
    mean = sum(lengths) / len(lengths)
    p99 = sorted(lengths)[int(0.99 * len(lengths))]
    assert mean == pytest.approx(1500, rel=0.15)
    assert p99 / mean == pytest.approx(5.0, rel=0.25)
    assert max(long_tail_lengths(4096, 16, 1500.0, 5.0, 6000, seed=0)) == 6000  # clipped


def test_summary_timeline_and_projection_rows():
    shapes = [StepShape((100, 10), 1)] * 2
    costs = UnitCosts(step_base_s=1.0, step_row_s=0.0, verify_factor=1.0, update_s=3.0,
                      push_s=2.0)
    cfg = SimConfig(workers=2, consolidate_below=1)
    runs = simulate_run(shapes, costs, cfg, {0: 2.0})
    summary = summarize(runs)
    assert set(summary) == set(MODES)
    assert summary["plain"]["step_s"] == 105.0 and summary["plain"]["speedup_vs_plain"] == 1.0
    assert summary["spec_spot"]["speedup_vs_plain"] == pytest.approx(105.0 / 55.0)
    assert summary["spec_spot"]["train_s"] == 2 * 45.0
    spans = timeline_spans(runs["spec_spot"][0], costs)
    assert [(s.worker, s.state, s.start_s, s.end_s) for s in spans] == [
        ("rollout0", "generate", 0.0, 50.0), ("rollout1", "generate", 0.0, 5.0),
        ("rollout1", "train", 5.0, 50.0), ("actor", "update", 50.0, 53.0),
        ("rollout0", "push", 53.0, 55.0), ("rollout1", "push", 53.0, 55.0)]
    rows = projections({"tiny": costs}, workers=(2,), steps=2, prompts_per_worker=2,
                       group_size=4, mean_tokens=50.0, max_len=400, prompt_tokens=8,
                       consolidate_below=2)
    assert [r["mode"] for r in rows] == list(MODES)
    assert all(r["label"] == "projection" and r["workers"] == 2 for r in rows)
    assert rows[0]["speedup_vs_plain"] == 1.0 and rows[1]["speedup_vs_plain"] > 1.0


def test_a_tensor_parallel_replica_reads_a_kth_of_the_weights_and_pays_its_all_reduces():
    costs = UnitCosts(step_base_s=8e-3, step_row_s=4e-5, draft_levels=6, draft_level_s=3e-4,
                      prefill_token_s=2e-5)
    tp = costs.over_ranks(4, layers=64, all_reduce_s=20e-6)
    assert tp.step_base_s == pytest.approx(2e-3 + 2 * 64 * 20e-6)
    assert tp.step_row_s == pytest.approx(1e-5) and tp.prefill_token_s == pytest.approx(5e-6)
    assert tp.draft_level_s == costs.draft_level_s   # the drafter is replicated, not split
    with pytest.raises(FastdraftError, match="k"):
        costs.over_ranks(0, 64, 0.0)


def test_projections_of_a_tensor_parallel_model_run_a_replica_per_k_devices():
    """4 devices at TP 2: the steps of 2 engines of twice the rows, on the TP costs."""
    costs = UnitCosts(step_base_s=0.01, step_row_s=1e-4, draft_levels=3, draft_level_s=1e-3)
    kw = dict(steps=2, prompts_per_worker=2, group_size=4, mean_tokens=50.0, max_len=400,
              prompt_tokens=8, consolidate_below=2, max_batch=8)
    tp = costs.over_ranks(2, 4, 1e-4)
    rows = projections({"m": tp}, workers=(4,), tensor_parallel={"m": 2}, **kw)
    assert {r["tensor_parallel"] for r in rows} == {2}
    shapes = [StepShape(long_tail_lengths(4 * 2 * 4, 4, 50.0, 5.0, 400,
                                          seed=4 * 1009 + step), 4, 8) for step in range(2)]
    two = summarize(simulate_run(shapes, tp, SimConfig(workers=2, max_batch=16,
                                                       consolidate_below=2),
                                   DEFAULT_ACCEPT))
    assert rows[0]["step_s"] == pytest.approx(two["plain"]["step_s"])
