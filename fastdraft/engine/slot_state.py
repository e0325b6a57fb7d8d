"""Per-slot state that lives on the device: the sampling settings of the request in each slot
(written once, when it is admitted) and the helper that moves any per-slot tensor when the
scheduler compacts the running batch."""

from __future__ import annotations

import torch

from fastdraft.engine.sampler import SamplingTensors
from fastdraft.engine.sampling_params import SamplingParams
from fastdraft.engine.scheduler import SlotMove


def move_slots(tensor: torch.Tensor, moves: list[SlotMove], slot_dim: int = 0,
               cell_dim: int | None = None) -> None:
    """Copies each move's src slot to its dst slot along slot_dim (only the first num_cells
    along cell_dim, when given). Every source is read before any destination is written, so
    the moves may be compactions or swaps."""
    if not moves:
        return
    src = torch.tensor([m.src for m in moves], device=tensor.device)
    dst = torch.tensor([m.dst for m in moves], device=tensor.device)
    if cell_dim is not None:
        tensor = tensor.narrow(cell_dim, 0, max(m.num_cells for m in moves))
    tensor.index_copy_(slot_dim, dst, tensor.index_select(slot_dim, src))


class SlotSampling:
    """SamplingTensors for every slot [num_slots]; a step reads rows 0..B-1 (free slots keep
    harmless settings: their outputs are discarded)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.tensors = SamplingTensors.build([SamplingParams(greedy=True)] * num_slots,
                                             vocab_size, device)

    def admit(self, slot_start: int, params: list[SamplingParams], seeds: list[int]) -> None:
        new = SamplingTensors.build(params, self.vocab_size, self.device, seeds)
        for mine, theirs in zip(_fields(self.tensors), _fields(new)):
            mine[slot_start: slot_start + len(params)] = theirs

    def move(self, moves: list[SlotMove]) -> None:
        for tensor in _fields(self.tensors):
            move_slots(tensor, moves)

    def rows(self, num_rows: int) -> SamplingTensors:
        return self.tensors.rows(0, num_rows)


def _fields(st: SamplingTensors) -> tuple[torch.Tensor, ...]:
    return st.temperature, st.top_k, st.top_p, st.is_greedy, st.keys
