"""Data-parallel drafter training's collectives, with two members on threads of this process
over one gloo store: gradients weighted by tokens (a member without a batch weighs nothing),
the freshest member's state to all, and one agreed answer to "go on?"."""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from fastdraft.trainer.data_parallel import agree, sync_state, token_weighted_grads


def _on_two(body) -> list:
    """body(pg, rank) on two members at once; their answers."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: list = [None, None]
    errors: list = []

    def member(rank: int) -> None:
        try:   # each member its own connection to the store, as in its own process
            store = dist.TCPStore("127.0.0.1", host.port, is_master=False)
            pg = dist.ProcessGroupGloo(dist.PrefixStore("t/", store), rank, 2,
                                       datetime.timedelta(seconds=30))
            out[rank] = body(pg, rank)
        except BaseException as err:   # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_gradients_are_weighted_by_each_members_tokens():
    grads = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([5.0, -2.0])}

    def body(pg, rank, tokens):
        param = torch.nn.Parameter(torch.zeros(2))
        param.grad = grads[rank].clone()
        assert token_weighted_grads(pg)([param], tokens[rank])
        return param.grad

    got = _on_two(lambda pg, rank: body(pg, rank, {0: 3, 1: 1}))
    for g in got:
        assert torch.allclose(g, (3 * grads[0] + grads[1]) / 4)
    got = _on_two(lambda pg, rank: body(pg, rank, {0: 3, 1: 0}))   # 1 had no batch
    for g in got:
        assert torch.allclose(g, grads[0])


def test_no_step_when_no_member_had_tokens():
    def body(pg, rank):
        param = torch.nn.Parameter(torch.zeros(2))
        return token_weighted_grads(pg)([param], 0)

    assert _on_two(body) == [False, False]


class _Trainer:
    """What sync_state reads of a SpotTrainer."""

    def __init__(self, value: float, steps: int, version: int) -> None:
        self.param = torch.nn.Parameter(torch.full((3,), value))
        self.optimizer = torch.optim.AdamW([self.param], lr=0.1)
        if steps:
            self.param.grad = torch.ones(3)
            self.optimizer.step()
        self.stats = type("S", (), {"steps": steps})()
        self.version = version
        self.serving = [torch.full((2,), 10 + value)]   # the drafter it last published

    def trainable(self):
        return [self.param]


def test_every_member_starts_a_round_from_the_freshest_state():
    trainers = {0: _Trainer(0.0, steps=0, version=0), 1: _Trainer(1.0, steps=4, version=3)}
    roots = _on_two(lambda pg, rank: sync_state(trainers[rank], pg, rank))
    assert roots == [1, 1]
    fresh, stale = trainers[1], trainers[0]
    assert torch.equal(stale.param, fresh.param)
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(stale.optimizer.state[stale.param][key],
                           fresh.optimizer.state[fresh.param][key])
    assert stale.stats.steps == 4 and stale.version == 3
    assert torch.equal(stale.serving[0], fresh.serving[0])


def test_the_serving_drafter_comes_from_the_newest_publisher_not_the_freshest_trainer():
    # Member 0 published last (version 5), member 1 trained on since (more micro-steps).
    trainers = {0: _Trainer(0.0, steps=0, version=5), 1: _Trainer(1.0, steps=4, version=3)}
    assert _on_two(lambda pg, rank: sync_state(trainers[rank], pg, rank)) == [1, 1]
    for t in trainers.values():
        assert torch.equal(t.param, trainers[1].param) and t.version == 5
        assert torch.equal(t.serving[0], torch.full((2,), 10.0))


def test_members_agree_to_stop_and_on_the_newest_round():
    assert _on_two(lambda pg, rank: agree(pg, rank == 1, 5 + rank)) == [(True, 6), (True, 6)]
    assert _on_two(lambda pg, rank: agree(pg, False, 2)) == [(False, 2), (False, 2)]
