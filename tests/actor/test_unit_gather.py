"""UnitGathered (the hybrid sync's gather): one FSDP unit at a time with the next unit's
all-gather running ahead, every parameter once and exact, and every unit sharded again
afterwards, whether the consumer takes everything, leaves early (finish) or is closed."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fastdraft.actor.rank import ActorRank
from fastdraft.actor.sharding import full_tensor
from tests.actor.test_actor import spec


def _all_sharded(model) -> bool:
    return all(isinstance(p, DTensor) for p in model.parameters())


def test_every_parameter_once_exact_and_every_unit_sharded_again(char_policy):
    rank = ActorRank(spec(char_policy, compute_dtype="bfloat16"), 0)   # FSDP2 over one rank
    model = rank.model
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    masters = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    gathered = rank.gathered_for(torch.bfloat16)
    seen = [(name, t.clone()) for name, t in gathered.named_parameters()]
    gathered.finish()
    assert [n for n, _ in seen] == [n for n in masters if n.startswith("model.layers.")] + [
        n for n in masters if not n.startswith("model.layers.")]
    assert all(torch.equal(t, masters[n].to(torch.bfloat16)) for n, t in seen)
    assert _all_sharded(model)

    early = rank.gathered_for(torch.bfloat16)   # a consumer that stops at the first layer
    next(iter(early.named_parameters()))
    early.finish()
    assert _all_sharded(model)

    closed = rank.gathered_for(torch.bfloat16)   # a consumer that raised: the walk is closed
    next(iter(closed.named_parameters()))
    closed._units.close()
    assert _all_sharded(model)
    again = rank.gathered_for(torch.bfloat16)
    assert all(torch.equal(t, masters[n].to(torch.bfloat16))
               for n, t in again.named_parameters())
    again.finish()
