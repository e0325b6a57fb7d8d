"""The engine's memory plan: the arithmetic at the 8B recipe's shape, the refusal before anything
is allocated (with a slot count that does fit), and the plan against what a tiny engine really
allocates, tensor by tensor, and against the live bytes of its steps."""

from __future__ import annotations

import re
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fastdraft.engine.engine as engine_module
import fastdraft.engine.memory_plan as memory_plan
from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.memory_plan import DrafterShape, check_engine_plan, plan_engine
from fastdraft.models import ModelConfig, load_model
from fastdraft.utils.device_memory import GB, Capacity
from tests.conftest import make_tiny_checkpoint

# Qwen3-8B's config.json (the shape of recipes/qwen3-8b-grpo.yaml's policy).
QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False)
RECIPE_SPEC = SpecConfig(method="eagle", depth=6, topk=4, tokens_to_verify=16)


def _plan_8b(slots: int = 256, max_seq_len: int = 3072):
    return plan_engine(ModelConfig.from_hf_dict(QWEN3_8B),
                       envelope=Envelope.for_spec(max_seq_len, RECIPE_SPEC), num_slots=slots,
                       dtype=torch.bfloat16, device="cuda:0", spec=RECIPE_SPEC,
                       drafter=DrafterShape(kind="eagle3", draft_vocab=32768))


def test_kv_cache_of_the_8b_recipe_before_its_fix_is_116_gb():
    plan = _plan_8b()
    # 3072 tokens + the largest tree's cells (depth 6 x topk 4 = 20 expanded nodes)
    assert plan.shape.envelope.cache_len == 3092
    cell = 36 * 2 * 8 * 128 * 2   # layers x (K, V) x kv heads x head dim x bf16
    assert cell == 147456
    assert plan.kv_cache == 256 * 3092 * cell
    assert 116e9 < plan.kv_cache < 117e9
    # 8.19B bf16 parameters (untied lm_head) and the fp32 rotary tables
    assert plan.weights == 8_190_735_360 * 2 + 2 * 3079 * 128 * 4
    # the drafter's own KV: one layer, the same cells
    assert plan.drafter_kv == 256 * (3092 * cell // 36 + 4096 * 2)
    assert plan.graph_pool > 0 and plan.total > 150e9


def test_refusal_names_the_settings_with_counts_that_fit():
    plan, capacity = _plan_8b(), Capacity.of("cuda:0", 80 * GB)
    with pytest.raises(ValueError) as err:
        check_engine_plan(plan, capacity)
    message = str(err.value)
    assert "116.7 GB" in message and "76.0 GB usable" in message
    slots = int(re.search(r"rollout\.max_batch_size \(.*?\) to <= (\d+)", message).group(1))
    assert plan.with_slots(slots).total <= capacity.usable < plan.with_slots(slots + 1).total
    seq = int(re.search(r"rollout\.max_seq_len \(.*?\) to <= (\d+)", message).group(1))
    assert plan.with_seq_len(seq).total <= capacity.usable < plan.with_seq_len(seq + 1).total
    check_engine_plan(plan.with_slots(slots), capacity)   # the count it names is accepted


def test_a_plan_the_weights_alone_overflow_says_so():
    with pytest.raises(ValueError, match="Not even one slot fits beside the weights"):
        check_engine_plan(_plan_8b(), Capacity.of("cuda:0", 18 * GB))


@pytest.fixture(scope="module")
def eagle3_policy(tmp_path_factory):
    """A tiny Qwen3 with a wide vocabulary (so the vocabulary-sized tables dominate, as at real
    sizes) and an EAGLE-3 drafter over half of it."""
    root = tmp_path_factory.mktemp("plan")
    make_tiny_checkpoint(root / "policy", "qwen3", vocab_size=2048, num_hidden_layers=4,
                         head_dim=16, max_position_embeddings=512)
    policy = load_model(root / "policy")
    drafter = build_drafter("eagle3", policy.config, 512).attach(policy)
    drafter.draft_token_ids = torch.arange(0, 2048, 2)
    save_drafter(drafter, root / "drafter")
    return root / "policy", root / "drafter"


def _engine(paths, **kwargs) -> RolloutEngine:
    policy, drafter = paths
    kwargs = {"max_batch_size": 6, "max_seq_len": 64, "max_prefill_tokens": 64,
              "drafter": drafter, "spec": SpecConfig(method="eagle", depth=4, topk=3,
                                                     tokens_to_verify=8), **kwargs}
    return RolloutEngine(policy, **kwargs)


def _fake_capacity(monkeypatch, free: int) -> None:
    monkeypatch.setattr(memory_plan, "device_capacity", lambda device, reserved=0: Capacity(
        device="cpu", total=free, free=free, margin=0, reserved=reserved))


def test_engine_is_refused_before_loading_or_allocating(eagle3_policy, monkeypatch, capsys):
    plan = _engine(eagle3_policy).memory_plan
    _fake_capacity(monkeypatch, plan.with_slots(3).total + 1)

    def never(*args, **kwargs):
        raise AssertionError("allocated before the memory plan was checked")

    monkeypatch.setattr(engine_module, "load_model", never)
    monkeypatch.setattr(engine_module, "ModelRunner", never)
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"rollout\.max_batch_size \(.*\) to <= 3 "):
        _engine(eagle3_policy)
    assert "engine memory plan (cpu, float32, 6 slots" in capsys.readouterr().out
    # Memory kept for the actor counts against the engine too.
    with pytest.raises(ValueError, match=r"reserved.*max_batch_size\) to <= 2 "):
        _engine(eagle3_policy, max_batch_size=3,
                memory_reserve=plan.with_slots(3).total - plan.with_slots(2).total)


def test_the_slot_count_a_refusal_names_builds(eagle3_policy, monkeypatch):
    plan = _engine(eagle3_policy).memory_plan
    _fake_capacity(monkeypatch, plan.with_slots(3).total + 1)
    engine = _engine(eagle3_policy, max_batch_size=3)
    assert engine.memory_plan == plan.with_slots(3)


def test_from_model_counts_the_weights_it_already_holds(eagle3_policy, monkeypatch):
    model = load_model(eagle3_policy[0])
    plan = _engine(eagle3_policy).memory_plan
    _fake_capacity(monkeypatch, plan.total - plan.weights)   # the rest, not the weights again
    spec = SpecConfig(method="eagle", depth=4, topk=3, tokens_to_verify=8)
    RolloutEngine.from_model(model, max_batch_size=6, max_seq_len=64, max_prefill_tokens=64,
                             drafter=eagle3_policy[1], spec=spec)
    _fake_capacity(monkeypatch, plan.total - plan.weights - 1)
    with pytest.raises(ValueError, match=r"rollout\.max_batch_size"):
        RolloutEngine.from_model(model, max_batch_size=6, max_seq_len=64,
                                 max_prefill_tokens=64, drafter=eagle3_policy[1], spec=spec)


def _storage_bytes(*roots: object) -> dict[int, int]:
    """Bytes of the distinct storages of every tensor reachable from roots (attributes, slots,
    containers, module parameters and buffers): shared and packed storages count once."""
    found: dict[int, int] = {}
    stack, seen = list(roots), set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            continue
        if isinstance(obj, torch.nn.Module):
            stack += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
        elif isinstance(obj, dict):
            stack += list(obj.values())
        names = [*vars(obj)] if hasattr(obj, "__dict__") else []
        names += [s for cls in type(obj).__mro__ for s in getattr(cls, "__slots__", ())]
        stack += [getattr(obj, n) for n in names if hasattr(obj, n)]
    return found


def test_tiny_engine_plan_is_what_it_allocates(eagle3_policy):
    engine = _engine(eagle3_policy)
    # A sampled rollout: the sampled trees' q table is allocated on the first one.
    engine.generate([[3, 4, 5]] * 6, SamplingParams(temperature=1.0, seed=0, max_new_tokens=8))
    plan, proposer = engine.memory_plan, engine.proposer
    weights = _storage_bytes(engine.model)
    drafter = {k: v for k, v in _storage_bytes(proposer.drafter, proposer.head.weight).items()
               if k not in weights}
    measured = {"weights": sum(weights.values()),
                "kv_cache": engine.runner.kv_cache.untyped_storage().nbytes(),
                "drafter_weights": sum(drafter.values()),
                "drafter_kv": sum(_storage_bytes(proposer.k, proposer.v,
                                                 proposer.root_feat).values()),
                "step_buffers": sum(_storage_bytes(engine.io).values())}
    for name, real in measured.items():
        assert getattr(plan, name) == pytest.approx(real, rel=0.03), name
    assert plan.step_buffers > 6 * 9 * 2048 * 4   # the [slots, 1 + nodes, vocab] q table


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created inside the mode (storages not in `skip`)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.live, self.peak, self._ids = skip, 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self.skip or id(storage) in self._ids:
                continue
            self._ids.add(id(storage))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out

    def _free(self, key: int, size: int) -> None:
        self._ids.discard(key)
        self.live -= size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_scratch_estimate_covers_the_steps_live_bytes(eagle3_policy, dtype):
    """The transient tensors of real sampled speculative steps (the graph pool's content on a
    GPU), at their peak, against the plan's estimate."""
    engine = _engine(eagle3_policy, dtype=dtype, max_batch_size=8,
                     spec=SpecConfig(method="eagle", depth=6, topk=4, tokens_to_verify=16))
    params = SamplingParams(temperature=1.0, seed=1, max_new_tokens=16)
    engine.generate([[3, 4, 5, 6]] * 8, params)   # lazy buffers allocated outside the count
    mode = _LiveBytes(set(_storage_bytes(engine)))
    with mode:
        engine.generate([[3, 4, 5, 6, 7]] * 8, params)
    plan = engine.memory_plan
    assert plan.graph_pool == 0   # CPU: nothing is held between steps
    assert mode.peak <= plan.step_scratch <= 1.1 * mode.peak
