"""Hidden-state capture: the policy's hidden states of every committed token, on every path
(prefill, plain decode, speculative verify), handed to one engine-level sink per generate call.
The online drafter trainer's DataBuffer is its consumer; proposers never see it.

Pairing (EAGLE's): `final[j]` is the policy's hidden state at position `positions[j]`, and
`token_ids[j]` is the token committed at `positions[j] + 1`, the one sampled (or accepted) from
the distribution that hidden state produced. A request's records, in order, cover positions
0 .. L - 2 of its prompt + answer (L tokens) and tokens 1 .. L - 1: its last token, the EOS
included, arrives in the record of the step that committed it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdraft.engine.request import Request
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, slots=True)
class HiddenRecord:
    """One request's commits of one engine step; tensors on the host, `dtype` of the capture."""

    request_index: int               # the prompt's index in the generate() call
    policy_version: int
    positions: torch.Tensor          # [n] long: positions of the hidden states
    token_ids: torch.Tensor          # [n] long: the token committed at positions + 1
    final: torch.Tensor              # [n, H]: final (normed) hidden states
    aux: tuple[torch.Tensor, ...]    # each [n, H]: inputs of the capture's aux layers

    def __post_init__(self) -> None:
        n = self.positions.shape[0]
        if self.token_ids.shape != (n,) or self.final.shape[0] != n or any(
                a.shape != self.final.shape for a in self.aux):
            raise FastdraftError(f"HiddenRecord of request {self.request_index}: positions, token "
                                 "ids, final and aux hidden states must have one row per token")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.positions, self.token_ids, self.final, *self.aux))


HiddenSink = Callable[[HiddenRecord], None]
#: (request indices, tokens each row committed) -> which rows the sink keeps. A sink that has a
#: `wants` method of this shape (see `row_filter`) is asked before anything is copied, so rows
#: it would drop (a byte budget, capture switched off) never leave the device.
RowFilter = Callable[[list[int], list[int]], list[bool]]


def row_filter(sink: HiddenSink) -> RowFilter | None:
    """The sink's `wants`, if it has one (a plain function or list.append keeps every row)."""
    return getattr(sink, "wants", None)


def emit_records(sink: HiddenSink, request_indices: list[int], start_positions: list[int],
                 kept: list[list[int]], final: torch.Tensor, aux: tuple[torch.Tensor, ...],
                 policy_version: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Hands the sink one record per row with commits: row i kept the tokens kept[i] (after
    stop tokens and length limits cut its path), paired with final[i, :len(kept[i])] ([B, W, H]
    device tensors, W >= every count). Rows the sink does not want (`row_filter`) are skipped;
    the rest are gathered and copied to the host once, then cloned per record, so no record
    holds the step's device activations or the others' rows."""
    rows = [i for i, tokens in enumerate(kept) if tokens]
    wants = row_filter(sink)
    if wants is not None and rows:
        verdicts = wants([request_indices[i] for i in rows], [len(kept[i]) for i in rows])
        rows = [i for i, keep in zip(rows, verdicts) if keep]
    if not rows:
        return
    width = max(len(kept[i]) for i in rows)
    host = _to_host((final, *aux), rows, width, dtype)
    for j, row in enumerate(rows):
        tokens, start = kept[row], start_positions[row]
        n = len(tokens)
        sink(HiddenRecord(
            request_index=request_indices[row], policy_version=policy_version,
            positions=torch.arange(start, start + n), token_ids=torch.tensor(tokens),
            final=host[0][j, :n].clone(), aux=tuple(h[j, :n].clone() for h in host[1:])))


def _to_host(tensors: tuple[torch.Tensor, ...], rows: list[int], width: int,
             dtype: torch.dtype) -> list[torch.Tensor]:
    """rows [:width] of each [B, W, H] tensor on the host in `dtype`: one gather on the device
    (none when the rows are 0..n-1), then one copy of just those rows."""
    if rows == list(range(len(rows))):
        return [t[: len(rows), :width].to("cpu", dtype) for t in tensors]
    index = torch.tensor(rows, device=tensors[0].device)
    return [t[:, :width].index_select(0, index).to("cpu", dtype) for t in tensors]


def emit_request_records(sink: HiddenSink, requests: list[Request], starts: list[int],
                         final: torch.Tensor, aux: tuple[torch.Tensor, ...],
                         policy_version: int) -> None:
    """Row i's hidden states (final[i, j]: position starts[i] + j) paired with the tokens
    request i now holds after them."""
    kept = [(r.prompt_token_ids + r.output_token_ids)[s + 1:] for r, s in zip(requests, starts)]
    emit_records(sink, [r.index for r in requests], starts, kept, final, aux, policy_version)


def commit_starts(requests: list[Request], num_before: list[int]) -> list[int]:
    """Position of each row's root in a decode or verify step (io.commit_final's first column)
    given the tokens each request held before the step."""
    return [len(r.prompt_token_ids) + b - 1 for r, b in zip(requests, num_before)]


def forward_aux_layers(proposer: tuple[int, ...], capture: tuple[int, ...], num_layers: int
                       ) -> tuple[int, ...]:
    """The aux layers every forward computes: the proposer's (EAGLE-3) or the capture's."""
    if any(not 0 <= i < num_layers for i in capture):
        raise FastdraftError(f"capture_aux_layers={capture}: layer indices must be in "
                             f"[0, {num_layers})")
    if proposer and capture and proposer != capture:
        raise FastdraftError(f"capture_aux_layers={capture} differ from the drafter's aux layers "
                             f"{proposer}: one forward computes one set; capture the drafter's")
    return proposer or capture
