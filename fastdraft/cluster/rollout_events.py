"""The event loop of one simulated rollout (fastdraft/cluster/simulator.py): W engines with
continuous batching, each admitting queued requests as rows finish, and optionally handing a
thin tail to another worker (tail consolidation). Engine steps are not simulated one by one:
between two events of a worker (a row finishes, requests arrive) its steps are all alike, so
an event schedules the whole run of them, and a rollout of 256 workers takes well under a
second. Pure Python."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from fastdraft.cluster.dispatch import assign_groups
from fastdraft.cluster.unit_costs import UnitCosts
from fastdraft.cluster.workload import StepShape

# Tokens after k steps are floor(k * accept_length): the slack keeps e.g. 3 * (10 / 3) at 10.
EPS = 1e-9


@dataclass(frozen=True)
class RolloutSetup:
    """What the event loop needs of a mode: speculative (verify steps, `accept` tokens a row a
    step) or not; consolidate_below 0 never hands a tail off."""
    workers: int
    max_batch: int
    dispatch: str
    speculative: bool
    accept: float
    consolidate_below: int = 0


@dataclass(slots=True)
class _Request:
    index: int
    length: int           # answer tokens
    need: int             # engine steps to generate them at this accept length
    pred_need: float      # the same from the predicted length: what the coordinator believes
    done: int = 0         # engine steps it ran before its current admission (on a donor)
    admitted_at: int = 0  # its worker's step count when admitted
    migrated: bool = False


@dataclass(slots=True)
class _Worker:
    """One engine. Its current run of identical engine steps: from seg_start, seg_steps steps of
    seg_cost seconds, the first also paying seg_prefill for the rows it admitted."""
    index: int
    queue: deque[_Request]
    running: list[tuple[int, int, _Request]] = field(default_factory=list)  # heap: finish step
    steps: int = 0               # engine steps run, as of its last event
    seg_start: float = 0.0
    seg_prefill: float = 0.0
    seg_cost: float = 0.0
    seg_steps: int = 0
    version: int = 0             # bumped when its pending event is replaced
    running_pred: float = 0.0    # sum over running of admitted_at - done + pred_need
    queued_pred: float = 0.0     # sum over queue of pred_need - done
    done_s: float | None = None  # when it ran out of requests

    def seg_end(self) -> float:
        return self.seg_start + self.seg_prefill + self.seg_steps * self.seg_cost

    def remaining(self) -> int:
        return len(self.running) + len(self.queue)

    def predicted_left(self) -> float:
        """Predicted engine steps its requests still need, as of its last event (kept as sums,
        so that choosing a receiver does not walk every request)."""
        return self.running_pred - len(self.running) * self.steps + self.queued_pred

    def generating(self) -> bool:
        return self.done_s is None and self.remaining() > 0


@dataclass
class RolloutOutcome:
    done_s: list[float]   # when each worker ran out of requests (0.0: it had none)
    migrated: int         # requests handed off

    @property
    def rollout_s(self) -> float:
        return max(self.done_s)


class Rollout:
    """One rollout: the workers' engines and the event queue. `run()` plays it out."""

    def __init__(self, shape: StepShape, costs: UnitCosts, setup: RolloutSetup) -> None:
        self.costs, self.setup = costs, setup
        self.prompt_tokens = shape.prompt_tokens
        self.workers = [_Worker(i, deque(requests))
                        for i, requests in enumerate(_dispatch(shape, setup))]
        # (time, worker, version): each worker's next event; ties go to the lower worker.
        self.events: list[tuple[float, int, int]] = [(0.0, w.index, 0) for w in self.workers]
        self.migrated = 0

    def run(self) -> RolloutOutcome:
        while self.events:
            now, index, version = heapq.heappop(self.events)
            worker = self.workers[index]
            if version == worker.version:  # else superseded by a cut run (`_interrupt`)
                self.step(worker, now)
        return RolloutOutcome([w.done_s for w in self.workers], self.migrated)

    def step(self, w: _Worker, now: float) -> None:
        """Worker w at an engine-step boundary: the rows that finished leave; a thin tail goes
        to another worker; queued requests join; then the next run of engine steps (until its
        next row finishes) or, with nothing left, it is done (idle, or training the drafter)."""
        self._advance(w)
        receiver = self._tail_receiver(w)
        if receiver is not None:
            self._hand_off(w, receiver, now)
        prefill = self._admit(w)
        if not w.running:
            w.done_s = now
            return
        rows = len(w.running)
        w.seg_start, w.seg_prefill, w.seg_steps = now, prefill, w.running[0][0] - w.steps
        w.seg_cost = (self.costs.verify_s(rows) if self.setup.speculative
                      else self.costs.step_s(rows))
        self._schedule(w)

    def _schedule(self, w: _Worker) -> None:
        w.version += 1
        heapq.heappush(self.events, (w.seg_end(), w.index, w.version))

    def _advance(self, w: _Worker) -> None:
        w.steps += w.seg_steps
        w.seg_steps = 0
        while w.running and w.running[0][0] <= w.steps:
            _, _, r = heapq.heappop(w.running)
            w.running_pred -= r.admitted_at - r.done + r.pred_need

    def _admit(self, w: _Worker) -> float:
        """Queued requests fill the batch; returns their prefill seconds."""
        prefill = 0.0
        while w.queue and len(w.running) < self.setup.max_batch:
            r = w.queue.popleft()
            w.queued_pred -= r.pred_need - r.done
            r.admitted_at = w.steps
            heapq.heappush(w.running, (w.steps + r.need - r.done, r.index, r))
            w.running_pred += r.admitted_at - r.done + r.pred_need
            # A migrated request's KV cache stayed with its donor: its prompt and the tokens
            # generated so far are prefilled again here.
            tokens = self.prompt_tokens + (self._generated(r) if r.migrated else 0)
            prefill += self.costs.prefill_token_s * tokens
        return prefill

    def _generated(self, r: _Request) -> int:
        return min(r.length, math.floor(r.done * self.setup.accept + EPS))

    def _tail_receiver(self, w: _Worker) -> _Worker | None:
        """Where w's tail goes, or None to keep it: once w's batch (with its queue admitted)
        is under consolidate_below rows, the other generating worker with the most predicted
        work left (ties: the lower index), whose batch runs longest anyway, so the extra rows
        ride along on steps it takes regardless; among those with batch room for the whole
        tail, since a tail that queues behind a full batch would wait for rows to finish.
        Never with one worker generating: there is nowhere to go."""
        rows = min(w.remaining(), self.setup.max_batch)
        if not 0 < rows < self.setup.consolidate_below:
            return None
        room = [o for o in self.workers if o is not w and o.generating()
                and o.remaining() + w.remaining() <= self.setup.max_batch]
        return max(room, key=lambda o: (o.predicted_left(), -o.index), default=None)

    def _hand_off(self, w: _Worker, receiver: _Worker, now: float) -> None:
        """w's requests, with the steps they ran, join receiver's queue; w is then done (it
        trains the drafter)."""
        running = sorted((r for _, _, r in w.running), key=lambda r: r.index)
        for r in running:
            r.done += w.steps - r.admitted_at  # the steps it ran here go with it
        moved = running + list(w.queue)
        for r in moved:
            r.migrated = True
            receiver.queue.append(r)
            receiver.queued_pred += r.pred_need - r.done
        self.migrated += len(moved)
        w.running, w.queue, w.running_pred, w.queued_pred = [], deque(), 0.0, 0.0
        self._interrupt(receiver, now)

    def _interrupt(self, w: _Worker, now: float) -> None:
        """Requests reach w at `now` and join at its next engine-step boundary: its run of
        identical steps is cut there (the step under way finishes)."""
        if w.seg_steps <= 1 or now >= w.seg_end():
            return  # its next event is that boundary already
        first_end = w.seg_start + w.seg_prefill + w.seg_cost
        under_way = (math.ceil((now - first_end) / w.seg_cost - EPS) + 1
                     if w.seg_cost > 0 else 1)  # 1-based: the step running at `now`
        if max(under_way, 1) < w.seg_steps:
            w.seg_steps = max(under_way, 1)
            self._schedule(w)


def _dispatch(shape: StepShape, setup: RolloutSetup) -> list[list[_Request]]:
    """Each worker's requests through the RolloutPool's own dispatch (fastdraft/cluster/
    dispatch.py: a group's cost is the sum of its predicted lengths) and in its order: a
    worker's groups in index order, a group's requests in index order."""
    g, predicted = shape.group_size, shape.predicted_lengths
    group_costs = [float(sum(predicted[i * g:(i + 1) * g])) for i in range(shape.num_groups)]
    owner = assign_groups(group_costs, setup.workers, setup.dispatch)

    def request(i: int) -> _Request:
        need = max(1, math.ceil(shape.lengths[i] / setup.accept - EPS))
        return _Request(i, shape.lengths[i], need=need, pred_need=predicted[i] / setup.accept)
    shares: list[list[_Request]] = [[] for _ in range(setup.workers)]
    for group, worker in enumerate(owner):
        shares[worker] += [request(i) for i in range(group * g, (group + 1) * g)]
    return shares
