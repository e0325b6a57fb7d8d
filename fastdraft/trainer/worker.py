"""SpotWorker: the SpotTrainer in a process of its own, so that it shares nothing with the RL
loop but the machine: no GIL (the engine's tail steps are Python-bound and a trainer thread in
the same process slowed them ~5x on the 2-core CPU), its own torch threads, its own DataBuffer,
and on a GPU its own CUDA context (spawned, never forked: CUDA cannot be forked).

Tensors cross as safetensors bytes (`_encode` / `_decode`), never as shared-memory handles:
torch's file-descriptor sharing runs out of descriptors over thousands of samples ("received 0
items of ancdata").

The loop talks to it through one command queue (samples, rewards, the policy's embedding and
lm_head, step boundaries, publish requests) and two events: `go` (train now: the rollout's tail
or the actor update) and, by clearing it, preemption. Between micro-steps the worker drains its
queue and checks `go`, so it idles within one micro-step of being told to. Published drafters
come back on a reply queue with their version and checksum.

Bounds: at most `inbox_samples` samples wait in the queue (a semaphore the worker releases as
it takes one; the sample after that is dropped and counted, never queued), and every wait for a
reply ends within `reply_timeout_s`: a worker that died, hung or raised becomes a WorkerFailure
for the caller (rl/online_drafter.py decides what happens next), never a hung run.
"""

from __future__ import annotations

import contextlib
import io
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from safetensors.torch import load, save

from fastdraft.databuffer import DataBuffer, Sample
from fastdraft.drafter.base import Drafter
from fastdraft.trainer.spot import PolicyHead, Published, SpotConfig, SpotStats, SpotTrainer
from fastdraft.utils.memory import release_free_memory, rss_mb
from fastdraft.utils.process import become_helper

#: CUDA maps any larger number to its lowest stream priority.
LOWEST_STREAM_PRIORITY = 1 << 20
#: Added to the reply timeout until the worker's first reply: starting a process (imports, a
#: CUDA context, the trainer's weights) is not hanging.
STARTUP_GRACE_S = 120.0


class WorkerFailure(RuntimeError):
    """The drafter worker died, hung past its reply timeout, or raised."""


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """Everything the worker process builds its trainer from (picklable). The trainer's
    device is spot.device."""

    drafter: Drafter                 # attached later to the worker's PolicyHead
    policy_config: Any
    embed: torch.Tensor
    lm_head: torch.Tensor | None     # None: tied to the embedding
    spot: SpotConfig
    buffer_bytes: int
    offset_mix: float
    seed: int
    num_threads: int
    max_steps_per_step: int = 0      # micro-steps per RL step at most (0: no cap)
    min_steps_per_step: int = 0      # at least, topped up by the publish (0: idle time only)
    state: bytes | None = None       # SpotTrainer.state() to continue from (torch.save bytes)
    max_sample_tokens: int | None = None   # longer samples are held as windows (DataBuffer)


def _serve(setup: WorkerSetup, inbox: mp.Queue, replies: mp.Queue, go: Any, slots: Any) -> None:
    become_helper()   # dies with the run; its stop signals are the run's to handle
    try:
        with _device_stream(torch.device(setup.spot.device)):
            _serve_loop(setup, inbox, replies, go, slots)
    except BaseException:
        # The loop learns why at its next wait instead of only seeing an exit code.
        replies.put(("error", traceback.format_exc(limit=8)))
        raise


def _device_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA: this process's device, and a stream of the lowest priority CUDA has for all of
    the trainer's kernels and copies, so that where kernels of several streams compete for the
    GPU (MPS, or anything sharing this context) the trainer's are the ones that wait. What
    keeps the trainer off the rollout's critical path is still the go / pause protocol: it
    trains only in the rollout's tail and during the actor update."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    torch.cuda.set_device(device)
    return torch.cuda.stream(torch.cuda.Stream(device, priority=LOWEST_STREAM_PRIORITY))


def _serve_loop(setup: WorkerSetup, inbox: mp.Queue, replies: mp.Queue, go: Any,
                slots: Any) -> None:
    torch.set_num_threads(setup.num_threads)
    torch.manual_seed(setup.seed)
    buffer = DataBuffer(setup.buffer_bytes, setup.offset_mix, seed=setup.seed,
                        max_sample_tokens=setup.max_sample_tokens)
    head = PolicyHead(setup.policy_config, setup.embed, setup.lm_head)
    trainer = SpotTrainer(setup.drafter, head, buffer, setup.spot)
    if setup.state is not None:
        trainer.load_state(unpickle_state(setup.state))
    cap = setup.max_steps_per_step or None
    while True:
        # Training: take what is queued without waiting, then one micro-step. Idle: wait.
        command = _poll(inbox, 0.0 if go.is_set() else 0.1)
        if command is not None:
            kind, payload = command
            if kind == "quit":
                return
            if kind == "sample" and slots is not None:
                slots.release()   # its place in the inbox is free again
            _handle(kind, payload, trainer, buffer, replies)
        elif go.is_set() and (cap is None or trainer.stats.steps - trainer.stats.steps_at_advance
                               < cap):
            if not trainer.step():
                time.sleep(0.005)   # nothing to train on yet
        elif go.is_set():
            time.sleep(0.005)       # this RL step's share of training is done


def _poll(inbox: mp.Queue, timeout: float) -> tuple[str, Any] | None:
    try:
        return inbox.get(timeout=timeout) if timeout else inbox.get_nowait()
    except queue.Empty:
        return None


def _encode(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({n: t.detach().cpu().contiguous() for n, t in tensors.items()})


def _decode(blob: bytes) -> dict[str, torch.Tensor]:
    return load(blob)


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


def _handle(kind: str, payload: Any, trainer: SpotTrainer, buffer: DataBuffer,
            replies: mp.Queue) -> None:
    if kind == "sample":
        buffer.add(_decode_sample(*payload))
    elif kind == "reward":
        buffer.set_reward(*payload)
    elif kind == "advance":
        buffer.advance_step()
        trainer.stats.steps_at_advance = trainer.stats.steps
        release_free_memory()   # a step's freed samples and batches back to the OS
    elif kind == "policy":
        trainer.sync_policy(_decode(payload).items())
    elif kind == "paused":   # the loop cleared `go` at payload (perf_counter); we are idle now
        trainer.record_preemption(payload)
        replies.put(("stats", trainer.stats))
    elif kind == "state":
        replies.put(("state", pickle_state(trainer.state())))
    elif kind == "publish":
        while (trainer.stats.steps - trainer.stats.steps_at_advance < payload
               and trainer.step()):   # the idle time did not reach the step's minimum
            pass
        published = trainer.publish()
        replies.put(("published", published.version, published.checksum,
                     _encode(dict(published.tensors)), trainer.stats,
                     buffer.stats(), rss_mb()))
    else:
        raise ValueError(f"SpotWorker: unknown command {kind!r}")


class SpotWorker:
    """The loop's handle on the worker process; DataBuffer-like on the producer side.
    reply_timeout_s: the longest wait for any reply; inbox_samples: samples queued at most
    (0: no bound); stats: the counters setup.state continues from (SpotStats.of_state)."""

    def __init__(self, setup: WorkerSetup, reply_timeout_s: float = 600.0,
                 inbox_samples: int = 0, stats: SpotStats | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._inbox, self._replies, self._go = ctx.Queue(), ctx.Queue(), ctx.Event()
        self._slots = ctx.Semaphore(inbox_samples) if inbox_samples else None
        self.process = ctx.Process(target=_serve, args=(setup, self._inbox, self._replies,
                                                        self._go, self._slots),
                                   name="fastdraft-spot-worker", daemon=True)
        self.process.start()
        self.reply_timeout_s = reply_timeout_s
        self.stats = stats or SpotStats()
        self.buffer_bytes = 0
        self.cut_samples = 0     # rollouts the buffer held as windows, since it started
        self.rss_mb: float | None = None   # the worker process's resident size, MiB
        self.inbox_dropped = 0             # samples dropped: the inbox was full
        self.closed = False
        self._replied = False              # the first reply may take STARTUP_GRACE_S longer

    @property
    def alive(self) -> bool:
        return not self.closed and self.process.is_alive()

    # producer side (what SampleCollector calls)
    def add(self, sample: Sample) -> None:
        if self._slots is not None and not self._slots.acquire(block=False):
            # The trainer is behind (or gone): drop, never queue without bound.
            self.inbox_dropped += 1
            return
        self._put(("sample", _encode_sample(sample)))

    def set_reward(self, key: tuple[int, int], reward: float | None) -> None:
        self._put(("reward", (key, reward)))

    def advance_step(self) -> None:
        self._put(("advance", None))

    def sync_policy(self, named_tensors) -> None:
        wanted = ("model.embed_tokens.weight", "lm_head.weight")
        self._put(("policy", _encode({n: t for n, t in named_tensors if n in wanted})))

    def _put(self, item: tuple) -> None:
        # A dead worker reads nothing: what is put for it would only pile up in this process.
        if self.alive:
            self._inbox.put(item)

    # control
    def go(self) -> None:
        self._go.set()

    def pause(self) -> None:
        """Stops training; returns once the worker has finished its micro-step (its stats,
        with the preemption latency, are then in self.stats)."""
        if not self._go.is_set():
            return
        self._go.clear()
        self._put(("paused", time.perf_counter()))
        self.stats = self._reply("stats")[1]

    def publish(self, min_steps: int = 0) -> Published:
        """The trainer's newest drafter, after topping its training this RL step up to
        min_steps micro-steps (while its buffer has data)."""
        self._put(("publish", min_steps))
        _, version, checksum, blob, self.stats, buffer, self.rss_mb = self._reply(
            "published")
        self.buffer_bytes, self.cut_samples = buffer.num_bytes, buffer.cut_samples
        return Published(version, checksum, list(_decode(blob).items()))

    def state(self) -> dict:
        """The trainer's state (SpotTrainer.state), for the run's checkpoint."""
        self._put(("state", None))
        return unpickle_state(self._reply("state")[1])

    def close(self, timeout_s: float = 30.0) -> None:
        """Ends the process within about timeout_s (asked to quit, then killed)."""
        self.closed = True
        if self.process.is_alive():
            self._go.clear()
            self._inbox.put(("quit", None))
            self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            self.process.kill()   # SIGKILL ends a hung (even a stopped) process too
            self.process.join(timeout=timeout_s)
        # A worker that died leaves what was put for it in the queue's pipe: without this the
        # interpreter's exit would wait forever for the queue's feeder thread to flush it.
        for q in (self._inbox, self._replies):
            q.cancel_join_thread()
            q.close()

    def _reply(self, kind: str) -> tuple:
        grace = 0.0 if self._replied else STARTUP_GRACE_S
        deadline = time.monotonic() + self.reply_timeout_s + grace
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailure(f"the drafter worker sent no {kind!r} reply in "
                                    f"{self.reply_timeout_s:g} s (drafter.online."
                                    "reply_timeout_s): it hangs")
            try:
                reply = self._replies.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not self.process.is_alive():
                    raise WorkerFailure(f"the drafter worker died (exit code "
                                        f"{self.process.exitcode})") from None
                continue
            except (OSError, ValueError, EOFError) as err:   # its queue is gone with it
                raise WorkerFailure(f"the drafter worker cannot be reached: {err}") from None
            if reply[0] == "error":
                lines = reply[1].strip().splitlines()
                raise WorkerFailure(f"the drafter worker raised {lines[-1] if lines else '?'}"
                                    f"\n{reply[1]}")
            if reply[0] == kind:
                self._replied = True
                return reply
