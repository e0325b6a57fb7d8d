"""vLLM's speculation statistics as fastdraft's SpecStats, per request: with
`per_request_spec_decode_metrics="summary"` every finished request carries a histogram of its
verify steps by accepted draft tokens (`RequestSpecDecodeMetrics`), exact for that engine. (Not
the Prometheus `vllm:spec_decode_*` counters of `LLM.get_metrics()`: their registry is the
process's, and with two engines in one process, as `bench recipe --backends` has, one engine's
counters went missing: its accept length read 1.0.) Both sides define the accept length the
same way: 1 + accepted draft tokens / verify steps."""

from __future__ import annotations

from typing import Any

from fastdraft.engine.spec.stats import SpecStats


def spec_stats_of(metrics: Any) -> SpecStats:
    """A request's SpecStats from its histogram: histogram[j] verify steps accepted j drafted
    tokens (a chain of num_spec_tokens), num_draft_tokens proposed in all."""
    hist = list(metrics.histogram)
    steps = sum(hist)
    depth = len(hist) - 1
    return SpecStats(num_drafted=int(metrics.num_draft_tokens),
                     num_accepted=sum(j * n for j, n in enumerate(hist)),
                     num_verify_steps=steps, drafted_by_pos=[steps] * depth,
                     # the draft token at depth i + 1 was accepted in steps accepting > i
                     accepted_by_pos=[sum(hist[i + 1:]) for i in range(depth)])
