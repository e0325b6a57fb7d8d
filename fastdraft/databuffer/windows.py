"""Windows: a rollout too long to hold or to train on in one piece, cut into contiguous runs of
positions, each a Sample of its own (positions kept, so RoPE and the one-step-offset pairing
stay the rollout's).

Neighbouring windows share one token: window k holds tokens [a, b), window k + 1 starts at
b - 1. A window trains the (hidden t, token t + 1) pairs inside it, predicting hidden t + 1;
with the shared token every hidden state of the rollout but the first is a target in exactly
one window, as it is in the uncut sample. (The drafter's own attention then reaches back to
the start of its window only: a long answer costs some context, not the answer.)

A long answer used to be refused (larger than the DataBuffer's capacity: the run died) or cut
to its first token_budget tokens when sampled (the answer's tail, where speculation pays most,
was never trained on).
"""

from __future__ import annotations

from fastdraft.databuffer.sample import Sample


def cut_windows(sample: Sample, max_tokens: int) -> list[Sample]:
    """`sample` as windows of at most max_tokens tokens (just [sample] when it fits). Windows
    with no loss-mask token (all prompt) are left out: nothing in them is trained."""
    if max_tokens < 2:
        raise ValueError(f"a window needs at least 2 tokens (one pair), got {max_tokens}")
    n = sample.num_tokens
    if n <= max_tokens:
        return [sample]
    out, begin = [], 0
    while True:
        end = min(begin + max_tokens, n)
        if bool(sample.loss_mask[begin:end].any()):
            out.append(sample.window(begin, end))
        if end == n:
            return out
        begin = end - 1


def tokens_within(sample: Sample, capacity_bytes: int) -> int:
    """The most tokens of `sample` that fit in capacity_bytes (every token of a sample costs
    the same bytes: its id, position, mask bit and hidden rows)."""
    per_token = sample.nbytes // sample.num_tokens
    return capacity_bytes // per_token
