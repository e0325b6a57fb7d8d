"""What a Ray rollout did, put together from its workers' parts (WorkerRollout): one trace on one
clock, the spec statistics, and every worker's generate / idle / train spans (the timeline)."""

from __future__ import annotations

from fastdraft.engine.spec.stats import SpecStats
from fastdraft.engine.trace import RolloutTrace
from fastdraft.observability.timeline import Span
from fastdraft.workers.rollout_worker import WorkerRollout


def account(done: list[tuple[int, WorkerRollout]], training: dict[int, float], start: float,
            end: float, n: int, followers: list[tuple[int, WorkerRollout]] = ()
            ) -> tuple[RolloutTrace, SpecStats, list[Span]]:
    """The rollout's trace (every worker's steps on one clock), spec statistics and each
    worker's generate / idle / train spans (a worker may have run more than one part: a
    re-run share, or a tail nobody took). followers: the parts of tensor-parallel ranks past
    their replica's first, which made the same steps: their spans only."""
    trace, stats = RolloutTrace(num_requests=n), SpecStats()
    spans = [Span(f"rollout{k}", "generate", max(part.start - start, 0.0),
                  max(part.end - start, 0.0)) for k, part in followers]
    events = []
    by_worker: dict[int, list[WorkerRollout]] = {}
    for k, part in done:
        by_worker.setdefault(k, []).append(part)
    for k, parts in sorted(by_worker.items()):
        name, at = f"rollout{k}", (lambda t: max(t - start, 0.0))
        parts.sort(key=lambda p: p.start)
        for i, part in enumerate(parts):
            stats.merge(part.stats)
            trace.prefill_tokens += part.trace.prefill_tokens
            trace.prefill_computed += part.trace.prefill_computed
            trace.preemptions += part.trace.preemptions
            trace.graph_captures += part.trace.graph_captures
            trace.graph_capture_s += part.trace.graph_capture_s
            base = part.start - part.trace.times[0] if part.trace.times else part.start
            events += [(base + t, k, a, arm, tok, dr) for t, a, arm, tok, dr in zip(
                part.trace.times, part.trace.active, part.trace.arms, part.trace.tokens,
                part.trace.drafting)]
            spans.append(Span(name, "generate", at(part.start), at(part.end)))
            if i and part.start - parts[i - 1].end > 1e-3:
                spans.append(Span(name, "idle", at(parts[i - 1].end), at(part.start)))
        last = parts[-1]
        if k in training:   # idle until its share was delivered, then the drafter's
            promoted = max(at(training[k]), at(last.end))
            spans += [Span(name, "idle", at(last.end), promoted),
                      Span(name, "train", promoted, end - start)]
        elif end - last.end > 1e-3:
            spans.append(Span(name, "idle", at(last.end), end - start))
    active = {k: 0 for k in by_worker}
    for t, k, a, arm, tok, dr in sorted(events):
        active[k] = a
        trace.times.append(t - start)
        trace.active.append(sum(active.values()))
        trace.end_step(arm, tok, dr)
    trace.end = end - start
    if trace.times:
        trace.times[0] = 0.0
    return trace, stats, spans
