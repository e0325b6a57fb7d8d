"""Inference-time weight packing, applied from outside the model: q/k/v and gate/up become views
into one matrix each, so a layer runs 4 matmuls instead of 7.

The HF-named parameters stay, as views of the packed storage, so in-place weight loads
(`load_named_tensors`, every RL step) update the packed matrices too. Autograd needs the separate
leaves, so modules use the packed path only when grad is off (the engine runs in inference mode).
Moving the model (`.to(...)`) after packing breaks the views: pack last.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdraft.errors import FastdraftError


def pack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenates the linears' weights (and biases) along the output dim and re-points each
    linear at its slice. Returns (weight [sum_out, in], bias [sum_out] | None)."""
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise FastdraftError("cannot pack linears where only some have a bias")
        bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None
    start = 0
    for lin in linears:
        stop = start + lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start:stop], requires_grad=lin.weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:stop], requires_grad=lin.bias.requires_grad)
        start = stop
    return weight, bias


def pack_for_inference(model: nn.Module) -> nn.Module:
    """Packs every module that knows how (Attention: qkv, MLP: gate_up); returns the model."""
    for module in model.modules():
        pack = getattr(module, "pack_for_inference", None)
        if pack is not None and module is not model:
            pack()
    return model
