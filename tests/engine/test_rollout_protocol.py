"""Every rollout the RL loop can hold declares the whole Rollout Protocol (engine/rollout.py):
fastdraft's engine in this process, the Ray pool (hybrid workers included) and the vLLM
backend; a member one of them lacks fails here, not in a run on that backend."""

from __future__ import annotations

import inspect

import pytest

from fastdraft.backends.vllm_rollout import VllmRollout
from fastdraft.engine import RolloutEngine
from fastdraft.engine.rollout import Rollout
from fastdraft.workers.pool import RolloutPool

MEMBERS = sorted(n for n in vars(Rollout) if not n.startswith("_"))
ATTRIBUTES = sorted(Rollout.__annotations__)   # set by the constructor


@pytest.mark.parametrize("cls", [RolloutEngine, RolloutPool, VllmRollout],
                         ids=lambda c: c.__name__)
def test_every_rollout_declares_the_protocol(cls):
    assert {"generate", "load_weights", "close", "spec", "captures_hidden"} <= set(MEMBERS)
    # what its methods set (the constructor, or the builders it calls)
    init = "".join(inspect.getsource(c) for c in cls.__mro__
                   if c.__module__.startswith("fastdraft"))

    def set_by_init(name: str) -> bool:
        return f"self.{name} =" in init or f", self.{name}" in init or f"self.{name}," in init

    for name in MEMBERS:
        declared = inspect.getattr_static(cls, name, None)
        expected = inspect.getattr_static(Rollout, name)
        if isinstance(expected, property):   # read: a property, a constant or an attribute
            assert ((declared is not None and (isinstance(declared, property)
                                              or not callable(declared)))
                    or set_by_init(name)), f"{cls.__name__} lacks Rollout.{name}"
        else:   # called: a method, the loop's calls binding to its signature
            assert callable(declared), f"{cls.__name__} lacks Rollout.{name}()"
            wanted = inspect.signature(expected).parameters
            given = inspect.signature(declared).parameters
            assert list(wanted)[:len(given)] == list(given)[:len(wanted)], (cls, name)
    for name in ATTRIBUTES:
        assert set_by_init(name), f"{cls.__name__} lacks Rollout.{name}"


def test_the_engine_in_this_process_is_a_rollout(char_policy):
    engine = RolloutEngine(char_policy, max_batch_size=2, max_seq_len=32)
    assert all(hasattr(engine, name) for name in [*MEMBERS, *ATTRIBUTES])
    engine.close()   # started nothing: nothing to end
