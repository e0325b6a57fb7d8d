"""FSDP2 for the actor (torch.distributed.fsdp.fully_shard): the process group its ranks share,
the sharded model built on the meta device and filled from rank 0's copy of the checkpoint, and
full tensors gathered back one parameter at a time.

Each decoder layer is its own FSDP unit (its parameters are all-gathered in the compute dtype
just before it runs and freed after), the embedding, final norm and lm_head are the root unit
(a tied lm_head must share the embedding's unit). Master weights, gradients and AdamW state stay
fp32 and sharded; gradients are reduced in fp32.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fastdraft.errors import FastdraftError
from fastdraft.models import CausalLM, ModelConfig
from fastdraft.models.loading import iter_safetensors, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A follower waits in a collective while rank 0 rolls out: allow a long rollout.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


def rank_device(base: str, rank: int) -> torch.device:
    """Rank r's device: the CPU for a CPU run, else the GPU `r` places after model.device."""
    device = torch.device(base)
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def free_port() -> int:
    """A TCP port nothing on this machine listens on now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_ranks(rank: int, world: int, address: str, port: int, device: torch.device) -> None:
    """Joins (or for one rank, creates) the default process group at rank 0's address:port:
    gloo on the CPU, nccl on GPUs. One rank still needs a group: FSDP2 shards over a mesh of
    one."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if world == 1 and dist.get_world_size() == 1:
            return   # an earlier one-rank actor of this process (tests) left one
        dist.destroy_process_group()
    if world == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        if address.startswith("127."):   # every rank on this machine: gloo's loopback device
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT)


def leave_ranks() -> None:
    """Rank 0's side of closing a multi-rank actor: its group dies with the followers."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.destroy_process_group()


def checkpoint_layers(model: CausalLM) -> CausalLM:
    """Activation checkpointing from outside the model: each decoder layer's forward runs under
    torch.utils.checkpoint (non-reentrant), so autograd keeps the layer's input and recomputes
    the rest in the backward. Parameter names are untouched (a wrapper module would prefix
    them), FSDP's hooks stay around the layer's call: its recompute sees the gathered weights."""
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return model


def shard(model: CausalLM, compute_dtype: torch.dtype, device: torch.device) -> CausalLM:
    """fully_shard every decoder layer, then the root (embedding, norm, lm_head)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def load_sharded(policy_dir: Path, device: torch.device, compute_dtype: torch.dtype,
                 max_positions: int, storage_dtype: torch.dtype = torch.float32) -> CausalLM:
    """The policy sharded over the process group, stored in storage_dtype (fp32 masters; a
    frozen reference stores the compute dtype): built on the meta device, sharded, then filled
    from rank 0's read of the checkpoint (broadcast), so no rank ever holds a full copy on its
    device and only rank 0 reads the files."""
    cfg = ModelConfig.from_pretrained(policy_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions).to(storage_dtype)
    shard(model, compute_dtype, device)
    model.to_empty(device=device)
    model.rope = type(model.rope)(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                  cfg.max_position_embeddings, max_positions).to(device)
    full: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        full = {n: t.float() for n, t in iter_safetensors(policy_dir)
                if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - set(full)
        if missing:
            raise FastdraftError(f"checkpoint {policy_dir} lacks {len(missing)} weights, e.g. "
                                 f"{sorted(missing)[:3]}")
    set_model_state_dict(model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))
    return model


def load_plain(policy_dir: Path, device: torch.device, max_positions: int) -> CausalLM:
    """One rank computing in fp32 needs no sharding: the model as it is, fp32."""
    return load_model(policy_dir, device, torch.float32, max_positions)


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter. Collective for a sharded one: every
    rank must call it, for the same parameters in the same order."""
    return param.full_tensor() if isinstance(param, DTensor) else param


class Gathered:
    """A sharded model's full parameters for one pass: `named_parameters()` gathers them one at
    a time as it is iterated (peak: one parameter); `finish()` gathers whatever the consumer
    left, so rank 0 always takes part in every gather its followers make, even when the
    consumer stopped early or raised. Single use. `config` is the model's."""

    def __init__(self, model: CausalLM) -> None:
        self.config = model.config
        self._model, self._done, self._started = model, 0, False

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("Gathered.named_parameters() runs once: each pass is a gather "
                               "every rank takes part in")
        self._started = True
        for name, param in self._model.named_parameters():
            tensor = full_tensor(param.detach())
            self._done += 1
            yield name, tensor

    def finish(self) -> None:
        for i, (_, param) in enumerate(self._model.named_parameters()):
            if i >= self._done:
                full_tensor(param.detach())
        self._done = sum(1 for _ in self._model.named_parameters())


def broadcast_flat(tensors: list[torch.Tensor], src: int) -> None:
    """`tensors` broadcast in place from rank `src` (every rank passes the same shapes and
    dtypes, in the same order): one collective per dtype, over a flat buffer."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src)
        for tensor, part in zip(group, flat.split([t.numel() for t in group])):
            tensor.copy_(part.view_as(tensor))


class UnitGathered:
    """A sharded model's full parameters in the compute dtype, gathered one FSDP unit at a time
    (FSDP2's `unshard`: one all-gather for a decoder layer's parameters together, one for the
    root's: what its forward does), for a consumer in that dtype (an engine serving in it: the
    gathered tensors are the fp32 masters cast as the engine's own cast would). The next
    layer's gather runs while the consumer copies this one's (FSDP2's own forward prefetch):
    peak the root and two layers. Same contract as Gathered: `named_parameters()` once,
    `finish()` always."""

    def __init__(self, model: CausalLM) -> None:
        self.config = model.config
        self._model = model
        self._units = self._walk()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._units

    def finish(self) -> None:
        for _ in self._units:   # the units the consumer left: every rank gathers them
            pass

    def _walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        model = self._model
        model.unshard()   # the root: embedding, final norm, lm_head
        layers = list(model.model.layers)
        ahead = None   # (index, handle): the next unit's all-gather, running while the
        try:           # consumer copies this one's tensors
            for i, layer in enumerate(layers):
                if ahead is None:
                    layer.unshard()
                else:
                    ahead[1].wait()
                ahead = (i + 1, layers[i + 1].unshard(async_op=True)) if i + 1 < len(
                    layers) else None
                try:
                    for name, param in layer.named_parameters():
                        yield f"model.layers.{i}.{name}", param.detach()
                finally:
                    layer.reshard()
            for name, param in model.named_parameters():
                if not name.startswith("model.layers."):
                    yield name, param.detach()
        finally:
            if ahead is not None:   # left early: that gather is done and given back too
                ahead[1].wait()
                layers[ahead[0]].reshard()
            model.reshard()
