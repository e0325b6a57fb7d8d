"""The actor's scores of a micro-batch's answer tokens from one forward: each answer token's
log-softmax(logits / T) under the policy (with its gradient, for the loss), and for the lossless
gate its TokenStats (algo/token_stats.py).

Two things keep a long answer's cost to its real tokens:
- packing (ScoreSpec.packed): the micro-batch's sequences lie end to end in one [1, N] row
  without padding (models/attn_meta.PackedSeqs: positions restart per sequence, attention
  stays within it), so a 20k answer beside short ones costs its own tokens, not 20k x rows;
- chunked logits: only answer positions are scored (a prompt's logits are never made), and
  `chunk_tokens` of them at a time: [chunk, V] fp32 temporaries instead of [N, V] logits. The
  backward makes each chunk's logits again (ChunkedLogprob) instead of keeping them.
Every [b, L - 1] output is laid out as algo/sequences.py says (column t scores token t + 1), 0
off the answer, so the loss and its normalisations see what a padded forward gives them."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdraft.algo.sequences import SequenceBatch, sequence_lengths
from fastdraft.algo.token_stats import CHUNK_BYTES, TokenStats, scaled_stats
from fastdraft.models.attn_meta import PackedSeqs
from fastdraft.models.decoder import HiddenStates

OnChunk = Callable[[int, int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreSpec:
    """temperature: the rollout's; chunk_tokens: answer positions whose logits exist at once
    (actor.logits_chunk_tokens; 0: all of a micro-batch's); packed: sequences without padding
    (actor.pack_sequences); top_p / top_k: the sampling filter the gate's statistics apply."""

    temperature: float
    chunk_tokens: int = 4096
    packed: bool = True
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.chunk_tokens < 0:
            raise ValueError(f"ScoreSpec: temperature {self.temperature} must be > 0, "
                             f"chunk_tokens {self.chunk_tokens} >= 0")


class AnswerScores:
    """One micro-batch laid out for the forward (packed or padded) and its answer positions."""

    def __init__(self, mb: SequenceBatch, spec: ScoreSpec) -> None:
        self.mb, self.spec = mb, spec
        dev = mb.input_ids.device
        self.rows, self.cols = mb.mask.nonzero(as_tuple=True)
        self.targets = mb.input_ids[self.rows, self.cols + 1]
        self.lengths = sequence_lengths(mb).tolist()
        if spec.packed:
            bounds = [0, *itertools.accumulate(self.lengths)]
            self.starts = torch.tensor(bounds[:-1], device=dev)
            self.input_ids = torch.cat([mb.input_ids[i, :n]
                                        for i, n in enumerate(self.lengths)]).unsqueeze(0)
            self.positions = torch.cat([torch.arange(n, device=dev)
                                        for n in self.lengths]).unsqueeze(0)
            self.attn: PackedSeqs | None = PackedSeqs(tuple(bounds))
            self.flat = self.starts[self.rows] + self.cols
        else:
            rows, width = mb.input_ids.shape
            self.input_ids = mb.input_ids
            self.positions = torch.arange(width, device=dev).expand(rows, -1)
            self.attn = None
            self.flat = self.rows * width + self.cols

    def forward(self, model: torch.nn.Module, aux_layers: tuple[int, ...] = (),
                stats: bool = False) -> tuple[torch.Tensor, TokenStats | None, HiddenStates]:
        """(logprobs [b, L - 1] fp32, with the gradient where enabled; the gate's TokenStats on
        the host, or None; the forward's hidden states, packed or padded as laid out)."""
        spec, count = self.spec, self.targets.shape[0]
        found = torch.zeros(4, count, device=self.targets.device) if stats else None

        def collect(start: int, end: int, scaled: torch.Tensor, target: torch.Tensor) -> None:
            step = max(1, CHUNK_BYTES // (4 * scaled.shape[1]))   # the filter's temporaries
            for i in range(0, end - start, step):
                j = min(i + step, end - start)
                found[:, start + i: start + j] = scaled_stats(scaled[i:j], target[i:j],
                                                              spec.top_p, spec.top_k)

        def score(final: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            picked = final.reshape(-1, final.shape[-1]).index_select(0, self.flat)
            return ChunkedLogprob.apply(picked, weight, self.targets, spec.temperature,
                                        spec.chunk_tokens or max(count, 1),
                                        collect if stats else None)

        logprob, hidden = model(self.input_ids, self.positions, attn=self.attn,
                                aux_layers=aux_layers, score=score)
        logprobs = logprob.new_zeros(self.mb.mask.shape).index_put((self.rows, self.cols),
                                                                   logprob)
        token_stats = None
        if found is not None:
            out = torch.zeros(4, *self.mb.mask.shape)
            out[:, self.rows.cpu(), self.cols.cpu()] = found.cpu()
            token_stats = TokenStats(*out.unbind(0))
        return logprobs, token_stats, hidden

    def row_states(self, t: torch.Tensor, row: int) -> torch.Tensor:
        """Row `row`'s first L - 1 positions of a hidden-state tensor of this layout."""
        n = self.lengths[row] - 1
        if self.attn is None:
            return t[row, :n]
        start = int(self.starts[row])
        return t[0, start: start + n]


class ChunkedLogprob(torch.autograd.Function):
    """log-softmax(h @ W^T / T) at each row's target, `chunk` rows at a time; the backward
    recomputes each chunk's logits, so no [rows, V] tensor outlives its chunk. Matches
    F.linear + float() / T + gather - logsumexp (algo/logprobs.logprobs_of), gradients
    included: the logits' gradient is cast to h's dtype before the matmuls, as autograd's is;
    with several chunks the head's gradient is summed over them in its own dtype."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                temperature: float, chunk: int, on_chunk: OnChunk | None) -> torch.Tensor:
        rows = h.shape[0]
        out = torch.empty(rows, dtype=torch.float32, device=h.device)
        lse = torch.empty_like(out)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            scaled = _scaled_logits(h[start:end], weight, temperature)
            lse[start:end] = scaled.logsumexp(-1)
            target = targets[start:end, None]
            out[start:end] = scaled.gather(-1, target).squeeze(-1) - lse[start:end]
            if on_chunk is not None:
                on_chunk(start, end, scaled, target)
            del scaled   # before the next chunk's is made
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        dh = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        # the head's gradient in its own dtype, as F.linear's backward makes it: the unsharded
        # gradient a sharded root keeps anyway (each chunk's part added by one addmm)
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, h.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, h.shape[0])
            g = grad[start:end, None].float()
            dz = _scaled_logits(h[start:end], weight, temperature)
            dz.sub_(lse[start:end, None]).exp_().mul_(-g)   # -g softmax, in place
            dz.scatter_add_(1, targets[start:end, None], g)  # + g at the target
            dz = dz.div_(temperature).to(h.dtype)
            if dh is not None:
                dh[start:end] = dz @ weight
            if dw is not None:
                dw.addmm_(dz.t(), h[start:end])
            del dz
        return dh, dw, None, None, None, None


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 (h @ W^T) / T, as F.linear + float() / T compute it (one fp32 tensor left)."""
    return (h @ weight.t()).float().div_(temperature)
