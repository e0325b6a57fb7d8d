"""Where a node's devices go, as the simulator sees one GRPO step: today's layouts against hybrid
workers, side by side (rollout, update, push, step seconds). Projections, not measurements: the
rollout is the simulator's (its unit costs, dispatch and long tail), the update a given figure
(the actor is FSDP2 over every device in all three), the push a transfer model over the node's
links (bandwidths below, effective, assumed):

- one_engine (cluster.backend=local): one engine on device 0 rolls out every request (its
  slots full, the rest queued) while devices 1..N-1 wait; the push is FSDP2's all-gather of
  the fp32 masters over the interconnect (every rank takes part), loaded on device 0.
- colocated (Ray rollout workers, actor ranks in other processes on their devices): every
  device rolls out; the push gathers fp32 to rank 0, copies it to the host, through the object
  store to every worker and onto its device, and the sleeping workers' weights go to the host
  and back (engine/sleep.py).
- hybrid (workers/hybrid.py): every device rolls out; the push is one all-gather of the
  weights in the serving dtype over the interconnect, straight into each replica.
Pure Python (no torch, no ray)."""

from __future__ import annotations

from dataclasses import dataclass

from fastdraft.cluster.simulator import SimConfig, StepShape, UnitCosts, simulate_step

LAYOUTS = ("one_engine", "colocated", "hybrid")
_GB = 1e9


@dataclass(frozen=True)
class NodeLinks:
    """Effective bandwidths, GB/s: a device's share of an all-gather over the interconnect
    (NVLink), a device <-> host copy (PCIe), and a copy through Ray's object store (host
    memory, serialised)."""

    interconnect: float = 150.0
    host: float = 25.0
    object_store: float = 5.0


def push_s(layout: str, params: float, serving_bytes: int, devices: int,
           links: NodeLinks) -> float:
    """Seconds from the updated shards to weights every rolling-out engine serves."""
    fp32, served = 4 * params / _GB, params * serving_bytes / _GB
    share = (devices - 1) / devices   # what a device receives of an all-gather
    if layout == "one_engine":
        return fp32 * share / links.interconnect
    if layout == "hybrid":
        return served * share / links.interconnect
    if layout == "colocated":   # gather, to host, object store out and in, onto each device
        moved = (fp32 * share / links.interconnect + fp32 / links.host
                 + 2 * fp32 / links.object_store + fp32 / links.host)
        return moved + 2 * served / links.host   # the sleeping weights out and back
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def compare_layouts(shape: StepShape, costs: UnitCosts, devices: int, max_batch: int,
                    update_s: float, params: float, serving_bytes: int = 2,
                    accept_length: float = 3.0, links: NodeLinks = NodeLinks()
                    ) -> list[dict[str, float | str]]:
    """One step of `shape` in each layout on `devices` devices (speculative decoding at
    `accept_length`): rows {layout, workers, rollout_s, update_s, push_s, step_s,
    vs_one_engine}, labelled projections."""
    rows: list[dict[str, float | str]] = []
    for layout in LAYOUTS:
        workers = 1 if layout == "one_engine" else devices
        rollout = simulate_step(shape, costs, SimConfig(workers=workers, max_batch=max_batch),
                                "spec_fixed", accept_length).rollout_s
        push = push_s(layout, params, serving_bytes, devices, links)
        rows.append({"layout": layout, "workers": workers, "rollout_s": rollout,
                     "update_s": update_s, "push_s": push,
                     "step_s": rollout + update_s + push, "label": "projection"})
    for row in rows:
        row["vs_one_engine"] = rows[0]["step_s"] / row["step_s"]
    return rows


def update_s_estimate(params: float, tokens: int, devices: int, tflops: float = 989.0,
                      mfu: float = 0.4) -> float:
    """An update's seconds from its FLOPs: 6 a parameter a token (forward and backward) and 2
    more for the activation checkpointing's recomputed forward, over `devices` devices of
    `tflops` dense bf16 TFLOP/s at `mfu` (default: an H100 at 40%)."""
    return 8 * params * tokens / (devices * tflops * 1e12 * mfu)
