"""TrainerGroup: data-parallel online drafter training on the rollout workers the long tail
leaves idle (cluster.drafter_training=data_parallel). One member, a TrainerActor, on every
rollout worker's bundle and device; every member receives every sample (a worker's share is
one Ray object, fetched from the node's object store) and draws its own batches.

The members that train together form a *round*: a gloo process group over one TCPStore the
driver hosts, in which each micro-step's gradients are summed weighted by tokens and every
member takes the same optimizer step (trainer/data_parallel.py). An idle worker's member is
promoted by starting a new round of the training members plus it; the members of the old
round leave it at their next micro-step boundary (they agree on that each micro-step) and
form the new one, which starts from the freshest member's state. A round always holds a
member with the freshest state: when the promoted ones have none (a new RL step's first idle
worker), a fresh member joins first without training, hands its state over and leaves.
A pause ends the round at the next boundary for all. During the actor's update every member
trains (drafter.online.during_update). The driver numbers what the group publishes, so
versions rise whichever member published.

The single RayTrainer (one trainer fed by all, on the last worker's bundle) is the default;
`fastdraft bench cluster` measures both side by side."""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

import torch.distributed as dist

from fastdraft.config.sections import OnlineDrafterConfig
from fastdraft.databuffer import Sample
from fastdraft.trainer.data_parallel import agree, token_weighted_grads
from fastdraft.trainer.service import TrainerHandle, TrainerSetup
from fastdraft.trainer.spot import Published, SpotStats
from fastdraft.workers.trainer_actor import Placement, RayTrainer, TrainerActor


class GroupMember(TrainerActor):
    """A TrainerActor whose training thread trains in rounds (it has no `go` of its own: a
    `join` is the go)."""

    def __init__(self, setup: TrainerSetup, index: int, store: tuple[str, int],
                 timeout_s: float) -> None:
        self.index = index
        self.store = dist.TCPStore(store[0], store[1], is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rounds: dict[int, tuple[tuple[int, ...], bool]] = {}   # id -> (members, train)
        self.told = self.formed = 0
        super().__init__(setup)   # starts the training thread (self._train)

    def join(self, round_id: int, members: tuple[int, ...], train: bool) -> None:
        """Round `round_id` of `members` (every one of them gets this call); train=False: only
        hand this member's state over, then leave."""
        with self._gate:
            self.rounds[round_id] = (members, train)
            self.told = max(self.told, round_id)
            if train:
                self._go.set()

    def _train(self) -> None:
        while not self.stopped.is_set():
            # Every round this member was told of, in order: its other members form each of
            # them too, so no one waits for a member that skipped one.
            with self._gate:
                pending = [r for r in self.rounds if r > self.formed]
            if pending:
                self._round(min(pending))
            else:
                time.sleep(0.005)

    def _round(self, round_id: int) -> None:
        self.formed = round_id
        with self._gate:
            members, train = self.rounds.pop(round_id)
        rank = members.index(self.index)
        with self._gate:
            self._idle.clear()
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"round{round_id}/", self.store), rank,
                                       len(members), self.timeout)
            self.service.round_start(pg, rank)
            reduce = token_weighted_grads(pg)
            while True:
                stop = not (train and self._go.is_set()) or self.service.capped()
                stop, newest = agree(pg, stop, self.told)
                if stop or newest > round_id:
                    return
                if not self.service.round_step(reduce):
                    time.sleep(0.005)   # nobody had anything to train on yet
        except RuntimeError as err:   # a member died or hung: the driver's timeouts act on it
            print(f"drafter trainer member {self.index}: round {round_id} ended: {err}")
        finally:
            self._idle.set()


class TrainerGroup(TrainerHandle):
    """The loop's handle on the members (RayTrainer handles of GroupMember actors); it is
    what OnlineDrafter holds in place of one trainer."""

    per_worker = True   # every idle worker is promoted, not only the first

    def __init__(self, setup: TrainerSetup, cfg: OnlineDrafterConfig, stats: SpotStats,
                 places: list[Placement]) -> None:
        import ray
        super().__init__(stats)
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        address = (host, self.store.port)
        self.members = [
            RayTrainer(_member_setup(setup, k), cfg, stats if k == 0 else SpotStats(), where,
                       body=GroupMember, args=(k, address, cfg.reply_timeout_s))
            for k, where in enumerate(places)]
        self.pid = self.members[0].pid
        self.version = int((setup.state or {}).get("version", 0))
        self.round = 0
        self.active: tuple[int, ...] = ()   # the members training now
        self.fresh: set[int] = set(range(len(self.members)))   # those with the newest state

    @property
    def alive(self) -> bool:
        return not self.closed and all(m.alive for m in self.members)

    @property
    def death(self) -> str:
        return next((f"member {k}: {m.death}" for k, m in enumerate(self.members)
                     if not m.alive), "closed")

    # producer side: every member gets everything
    def add(self, sample: Sample) -> None:
        for member in self.members:
            member.add(sample)

    def add_many(self, samples: list[Sample] | Any) -> None:
        if isinstance(samples, list):   # the driver's own (drafter.online.source=actor): once
            import ray
            samples = ray.put(samples)
        for member in self.members:
            member.add_many(samples)

    def set_reward(self, key: tuple[int, int], reward: float | None) -> None:
        for member in self.members:
            member.set_reward(key, reward)

    def advance_step(self) -> None:
        for member in self.members:
            member.advance_step()

    def sync_policy(self, named_tensors) -> None:
        named = list(named_tensors)
        for member in self.members:
            member.sync_policy(named)

    # control
    def go(self, worker: int | None = None, every: bool = False) -> None:
        """Trains on idle `worker`'s member too; every: on all members (while the actor
        updates). Neither (the online drafter's tail threshold, which does not know which
        workers are idle): no one new; the training members get what is held."""
        wanted = (set(range(len(self.members))) if every
                  else {*self.active} if worker is None else {*self.active, worker})
        if wanted == set(self.active):
            for k in self.active:
                self.members[k].go()   # (sends what it holds)
            return
        members = tuple(sorted(wanted))
        if not self.fresh & wanted:   # a fresh member hands its state over first
            giver = min(self.fresh)
            self.round += 1
            handover = tuple(sorted({*members, giver}))
            for k in handover:
                self.members[k].join(self.round, handover, train=False)
        self.round += 1
        for k in members:
            self.members[k].join(self.round, members, train=True)
        self.active, self.fresh = members, set(members)

    def pause(self) -> None:
        for k in self.active:
            self.members[k].pause()
        self.active = ()

    def settle(self) -> None:
        """Every member's pause in effect, and every member alive (a dead one fails the group:
        the online drafter restarts it whole from the last good drafter)."""
        for member in self.members:
            member.settle()
            member.ping()
        self.stats = self._merged()

    def publish(self, min_steps: int = 0) -> Published:
        self.settle()
        k = max(self.fresh, key=lambda i: (self.members[i].stats.steps, -i))
        steps = self.members[k].stats.steps
        published = self.members[k].publish(min_steps)
        if self.members[k].stats.steps > steps:   # the top-up trained it alone
            self.fresh = {k}
        self.version += not published.withheld
        reply = self.members[k]
        self.buffer_bytes, self.cut_samples, self.rss_mb = (
            reply.buffer_bytes, reply.cut_samples, reply.rss_mb)
        self.stats = self._merged()
        return dataclasses.replace(published, version=self.version)

    def state(self) -> dict:
        self.settle()
        k = max(self.fresh, key=lambda i: (self.members[i].stats.steps, -i))
        return {**self.members[k].state(), "version": self.version}

    def close(self, timeout_s: float = 30.0) -> None:
        self.closed = True
        for member in self.members:
            member.close(timeout_s)

    @property
    def inbox_dropped(self) -> int:   # type: ignore[override]
        return sum(m.inbox_dropped for m in self.members)

    @inbox_dropped.setter
    def inbox_dropped(self, value: int) -> None:
        pass   # the members count their own

    def _merged(self) -> SpotStats:
        """The group's counters: micro-steps of the freshest member (a round's step counts
        once), tokens and preemptions of all members."""
        stats = [m.stats for m in self.members]
        fresh = max(stats, key=lambda s: s.steps)
        return dataclasses.replace(
            fresh, tokens=sum(s.tokens for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            preemption_latencies_s=[t for s in stats for t in s.preemption_latencies_s],
            last=dict(fresh.last))


def _member_setup(setup: TrainerSetup, k: int) -> TrainerSetup:
    """Member k's: its own sampling seed; a restored state's counters on member 0 only (the
    group's tokens and preemptions are the members' sum)."""
    state = setup.state
    if state is not None and k:
        state = {**state, "tokens": 0, "preemptions": 0}
    return dataclasses.replace(setup, seed=setup.seed + k, state=state)
