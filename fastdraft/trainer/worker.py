"""SpotWorker: the local backend's handle on the online trainer (trainer/service.py) in a
process of its own, so that it shares nothing with the RL loop but the machine: no GIL (the
engine's tail steps are Python-bound and a trainer thread in the same process slowed them ~5x
on the 2-core CPU), its own torch threads, its own DataBuffer, and on a GPU its own CUDA
context (spawned, never forked: CUDA cannot be forked). The Ray backend serves the same
TrainerService from a Ray actor instead (workers/trainer_actor.py).

The loop calls the service's methods by name through one queue, `(method, args)`; the three
that answer (`paused`, `publish`, `state`) answer on a reply queue, `(method, value)`. One
event, `go`, says train now (the rollout's tail or the actor update); clearing it preempts:
between micro-steps the process drains its queue and checks `go`, so it idles within one
micro-step of being told to.

Tensors cross the queues as safetensors bytes (`_encode` / `_decode`), never as shared-memory
handles: torch's file-descriptor sharing runs out of descriptors over thousands of samples
("received 0 items of ancdata"). A Ray actor needs none of this (Ray serializes tensors).

Bounds: at most `inbox_samples` samples wait in the queue (a semaphore the process releases as
it takes one; the sample after that is dropped and counted, never queued), and every wait for a
reply ends within `reply_timeout_s`: a process that died, hung or raised becomes a
WorkerFailure for the caller (trainer/online_drafter.py decides what happens next), never a
hung run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import queue
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp
from safetensors.torch import load, save

from fastdraft.databuffer import Sample
from fastdraft.trainer.service import (
    PublishReply,
    TrainerHandle,
    TrainerService,
    TrainerSetup,
    WorkerFailure,
    policy_head_tensors,
)
from fastdraft.trainer.spot import Published, SpotStats
from fastdraft.utils.objects import resolved
from fastdraft.utils.process import become_helper

#: CUDA maps any larger number to its lowest stream priority.
LOWEST_STREAM_PRIORITY = 1 << 20
#: Added to the reply timeout until the worker's first reply: starting a process (imports, a
#: CUDA context, the trainer's weights) is not hanging.
STARTUP_GRACE_S = 120.0
#: The service's methods that answer.
ANSWERING = ("paused", "publish", "state")


def _serve(setup: TrainerSetup, inbox: mp.Queue, replies: mp.Queue, go: Any, slots: Any) -> None:
    become_helper()   # dies with the run; its stop signals are the run's to handle
    try:
        with device_stream(torch.device(setup.spot.device)):
            _serve_loop(setup, inbox, replies, go, slots)
    except BaseException:
        # The loop learns why at its next wait instead of only seeing an exit code.
        replies.put(("error", traceback.format_exc(limit=8)))
        raise


def device_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA: this process's device, and a stream of the lowest priority CUDA has for all of
    the trainer's kernels and copies, so that where kernels of several streams compete for the
    GPU (MPS, or anything sharing this context) the trainer's are the ones that wait. What
    keeps the trainer off the rollout's critical path is still the go / pause protocol: it
    trains only in the rollout's tail and during the actor update."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if device.index is None:   # "cuda": the current one (set_device wants an index)
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return torch.cuda.stream(torch.cuda.Stream(device, priority=LOWEST_STREAM_PRIORITY))


def _serve_loop(setup: TrainerSetup, inbox: mp.Queue, replies: mp.Queue, go: Any,
                slots: Any) -> None:
    state = None if setup.state is None else unpickle_state(setup.state)
    service = TrainerService(dataclasses.replace(setup, state=state))
    while True:
        # Training: take what is queued without waiting, then one micro-step. Idle: wait.
        command = _poll(inbox, 0.0 if go.is_set() else 0.1)
        if command is not None:
            method, args = command
            if method == "quit":
                return
            if method == "add":
                if slots is not None:
                    slots.release()   # its place in the inbox is free again
                args = (_decode_sample(*args),)
            elif method == "sync_policy":
                args = (_decode(args[0]),)
            value = getattr(service, method)(*args)
            if method in ANSWERING:
                replies.put((method, _to_wire(value)))
        elif go.is_set() and not service.micro_step():
            time.sleep(0.005)   # nothing to train on yet, or this RL step's share is done


def _poll(inbox: mp.Queue, timeout: float) -> tuple[str, Any] | None:
    try:
        return inbox.get(timeout=timeout) if timeout else inbox.get_nowait()
    except queue.Empty:
        return None


def _encode(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({n: t.detach().cpu().contiguous() for n, t in tensors.items()})


def _decode(blob: bytes) -> dict[str, torch.Tensor]:
    return load(blob)


def _to_wire(value: Any) -> Any:
    """An answer as it crosses the reply queue: tensors as bytes."""
    if isinstance(value, PublishReply):
        p = value.published
        return dataclasses.replace(value, published=dataclasses.replace(
            p, tensors=_encode(dict(p.tensors))))
    if isinstance(value, dict):   # a trainer state
        return pickle_state(value)
    return value


def pickle_state(tree: dict) -> bytes:
    """A state tree (optimizer state: tensors in nested dicts) as bytes, between our own
    processes only."""
    buf = io.BytesIO()
    torch.save(tree, buf)
    return buf.getvalue()


def unpickle_state(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _encode_sample(s: Sample) -> tuple[dict[str, Any], bytes]:
    tensors = {"token_ids": s.token_ids, "positions": s.positions, "hidden": s.hidden,
               "loss_mask": s.loss_mask, **{f"aux{i}": a for i, a in enumerate(s.aux_hidden)}}
    meta = {"request_index": s.request_index, "policy_version": s.policy_version,
            "rl_step": s.rl_step, "reward": s.reward, "num_aux": len(s.aux_hidden)}
    return meta, _encode(tensors)


def _decode_sample(meta: dict[str, Any], blob: bytes) -> Sample:
    t = _decode(blob)
    aux = tuple(t[f"aux{i}"] for i in range(meta["num_aux"]))
    return Sample(request_index=meta["request_index"], policy_version=meta["policy_version"],
                  rl_step=meta["rl_step"], reward=meta["reward"], token_ids=t["token_ids"],
                  positions=t["positions"], hidden=t["hidden"], loss_mask=t["loss_mask"],
                  aux_hidden=aux)


class SpotWorker(TrainerHandle):
    """The loop's handle on the trainer's process; DataBuffer-like on the producer side.
    reply_timeout_s: the longest wait for any reply; inbox_samples: samples queued at most
    (0: no bound); stats: the counters setup.state continues from (SpotStats.of_state)."""

    def __init__(self, setup: TrainerSetup, reply_timeout_s: float = 600.0,
                 inbox_samples: int = 0, stats: SpotStats | None = None) -> None:
        super().__init__(stats)
        ctx = mp.get_context("spawn")
        self._inbox, self._replies, self._go = ctx.Queue(), ctx.Queue(), ctx.Event()
        self._slots = ctx.Semaphore(inbox_samples) if inbox_samples else None
        if setup.state is not None:   # as bytes, like every tensor that crosses
            setup = dataclasses.replace(setup, state=pickle_state(setup.state))
        self.process = ctx.Process(target=_serve, args=(setup, self._inbox, self._replies,
                                                        self._go, self._slots),
                                   name="fastdraft-spot-worker", daemon=True)
        self.process.start()
        self.reply_timeout_s = reply_timeout_s
        self._replied = False              # the first reply may take STARTUP_GRACE_S longer

    @property
    def alive(self) -> bool:
        return not self.closed and self.process.is_alive()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def death(self) -> str:
        return f"exit code {self.process.exitcode}"

    # producer side (what SampleCollector calls)
    def add(self, sample: Sample) -> None:
        self._enqueue(sample, wait_s=0.0)   # the trainer behind (or gone): drop, never pile up

    def add_many(self, samples: list[Sample] | Any) -> None:
        """A batch at once (the actor's forward over a step's rollout: drafter.online.source=
        actor) outruns the process's draining without the trainer being behind, which is what
        add()'s drop guards against: each sample waits for room, the batch at most
        reply_timeout_s in all (the process drains its inbox before every micro-step); what
        still finds none is dropped and counted. (Dropping the burst's tail lost ~40% of every
        step's samples, always the last requests', with the miniature's 64-sample inbox.)"""
        deadline = time.monotonic() + self.reply_timeout_s
        for sample in resolved(samples):
            self._enqueue(sample, wait_s=max(0.0, deadline - time.monotonic()))

    def _enqueue(self, sample: Sample, wait_s: float) -> None:
        """Into the inbox if a place frees within wait_s, else dropped and counted."""
        if self._slots is not None and not (self.alive and self._slots.acquire(timeout=wait_s)):
            self.inbox_dropped += 1
            return
        self._put("add", *_encode_sample(sample))

    def set_reward(self, key: tuple[int, int], reward: float | None) -> None:
        self._put("set_reward", key, reward)

    def advance_step(self) -> None:
        self._put("advance_step")

    def sync_policy(self, named_tensors) -> None:
        self._put("sync_policy", _encode(policy_head_tensors(named_tensors)))

    def _put(self, method: str, *args: Any) -> None:
        # A dead process reads nothing: what is put for it would only pile up in this one.
        if self.alive:
            self._inbox.put((method, args))

    # control
    def go(self, worker: int | None = None, every: bool = False) -> None:
        self._go.set()

    def pause(self) -> None:
        if not self._go.is_set():
            return
        self._go.clear()
        self._put("paused", time.perf_counter())
        self.stats = self._reply("paused")

    def publish(self, min_steps: int = 0) -> Published:
        self._put("publish", min_steps)
        reply = self._reply("publish")
        p = reply.published
        return self._answered(dataclasses.replace(
            reply, published=dataclasses.replace(p, tensors=list(_decode(p.tensors).items()))))

    def state(self) -> dict:
        self._put("state")
        return unpickle_state(self._reply("state"))

    def close(self, timeout_s: float = 30.0) -> None:
        """Ends the process within about timeout_s (asked to quit, then killed)."""
        self.closed = True
        if self.process.is_alive():
            self._go.clear()
            self._inbox.put(("quit", ()))
            self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            self.process.kill()   # SIGKILL ends a hung (even a stopped) process too
            self.process.join(timeout=timeout_s)
        # A process that died leaves what was put for it in the queue's pipe: without this the
        # interpreter's exit would wait forever for the queue's feeder thread to flush it.
        for q in (self._inbox, self._replies):
            q.cancel_join_thread()
            q.close()

    def _reply(self, method: str) -> Any:
        grace = 0.0 if self._replied else STARTUP_GRACE_S
        deadline = time.monotonic() + self.reply_timeout_s + grace
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailure(f"the drafter worker sent no {method!r} reply in "
                                    f"{self.reply_timeout_s:g} s (drafter.online."
                                    "reply_timeout_s): it hangs")
            try:
                kind, value = self._replies.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not self.process.is_alive():
                    raise WorkerFailure(f"the drafter worker died ({self.death})") from None
                continue
            except (OSError, ValueError, EOFError) as err:   # its queue is gone with it
                raise WorkerFailure(f"the drafter worker cannot be reached: {err}") from None
            if kind == "error":
                lines = value.strip().splitlines()
                raise WorkerFailure(f"the drafter worker raised {lines[-1] if lines else '?'}"
                                    f"\n{value}")
            if kind == method:
                self._replied = True
                return value
