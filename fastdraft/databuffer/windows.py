"""Windows: a rollout too long to hold or to train on in one piece, cut into contiguous runs of
positions, each a Sample of its own (positions kept, so RoPE and the one-step-offset pairing
stay the rollout's).

Neighbouring windows share one token: window k holds tokens [a, b), window k + 1 scores from
b - 1 on. A window trains the (hidden t, token t + 1) pairs inside it, predicting hidden t + 1;
with the shared token every hidden state of the rollout but the first is a target in exactly
one window, as it is in the uncut sample.

Context: window k + 1 begins `context` tokens before b - 1, and those tokens are attended to but
not scored (loss mask off). At inference the drafter attends to every earlier token of the
rollout; a window that starts bare makes it predict its first tokens from nothing, and
training on such pairs teaches it to draft without context. Measured on the miniature
(EAGLE-3, 128-token windows, 12 micro-steps of the warm-up drafter on its own policy's
rollouts; accept length 6.12 before): whole samples 6.22, bare windows 5.98-6.04, windows with
64 tokens of context 6.17-6.19 (the first online drafters' dip below the warm-up one).

What a window still lacks is the rollout's prompt (and the answer before its context). Where an
answer keeps consulting its prompt, as the miniature's task does (answer step i needs prompt
digit i, far behind a late window), a drafter trained on such windows learns to draft deeper
levels without it: with 128-token windows (a quarter of the miniature's rollouts cut) the
online drafter lost 3-6% of accept length at its third step in 7 of 9 runs, with 256-token
windows or none it did not (docs/vllm-backend.md). So `max_sample_tokens` should hold all but
the longest rollouts; windows led by the prompt would serve answers much longer than their
prompts (not built: on the miniature a cut rollout's prompt fills half its window).

A long answer used to be refused (larger than the DataBuffer's capacity: the run died) or cut
to its first token_budget tokens when sampled (the answer's tail, where speculation pays most,
was never trained on).
"""

from __future__ import annotations

import torch

from fastdraft.databuffer.sample import Sample
from fastdraft.errors import FastdraftError


def cut_windows(sample: Sample, max_tokens: int, context: int = 0) -> list[Sample]:
    """`sample` as windows of at most max_tokens tokens (just [sample] when it fits), each but
    the first led by `context` unscored tokens (at most max_tokens - 2: a window scores one
    pair at least). Windows with no loss-mask token (all prompt) are left out: nothing in them
    is trained."""
    if max_tokens < 2:
        raise FastdraftError(f"a window needs at least 2 tokens (one pair), got {max_tokens}")
    if not 0 <= context <= max_tokens - 2:
        raise FastdraftError(f"a window of {max_tokens} tokens can lead with 0 to {max_tokens - 2} "
                             f"tokens of context, got {context}")
    n = sample.num_tokens
    if n <= max_tokens:
        return [sample]
    out, begin, scored_from = [], 0, 0
    while True:
        end = min(begin + max_tokens, n)
        window = sample.window(begin, end)
        if scored_from > begin:   # the context: attended to, scored by the window before
            window = window.with_loss_mask(window.loss_mask & (
                torch.arange(end - begin) >= scored_from - begin))
        if bool(window.loss_mask.any()):
            out.append(window)
        if end == n:
            return out
        scored_from = end - 1
        begin = max(scored_from - context, 0)


def tokens_within(sample: Sample, capacity_bytes: int) -> int:
    """The most tokens of `sample` that fit in capacity_bytes (every token of a sample costs
    the same bytes: its id, position, mask bit and hidden rows)."""
    per_token = sample.nbytes // sample.num_tokens
    return capacity_bytes // per_token
