"""Values are checked where the config is built: every numeric key declares its Range (a key
added without one fails here), a value just outside it, a non-finite float or a boolean is one
line naming the dotted key; a key given twice in a recipe is refused with both lines; the
cross-key limits (group size, sequence length, tree size, answer column) are named at load."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path

import pytest

from fastdraft.cli import main
from fastdraft.config import RunConfig, load_recipe
from fastdraft.config.sections.common import INT64_MAX, Range, ranged_fields
from fastdraft.errors import FastdraftError

TINY = Path(__file__).parents[2] / "recipes" / "tiny-grpo.yaml"


def _strip(hint):
    """The hint without Optional and Annotated wrappers."""
    while True:
        origin = typing.get_origin(hint)
        if origin is typing.Annotated:
            hint = typing.get_args(hint)[0]
        elif origin in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(hint) if a is not type(None)]
            if len(rest) != 1:
                return hint
            hint = rest[0]
        else:
            return hint


def _is_numeric(hint) -> bool:
    if hint in (int, float):
        return True
    return typing.get_origin(hint) is tuple and all(a in (int, float)
                                                     for a in typing.get_args(hint))


def numeric_leaves(cls: type = RunConfig, where: str = ""):
    """(dotted key, class, field name, base type) of every int / float / tuple-of-numbers key
    reachable from RunConfig, read from the type hints (not from the Ranges)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        base = _strip(hints[f.name])
        if dataclasses.is_dataclass(base):
            yield from numeric_leaves(base, key)
        elif _is_numeric(base):
            yield key, cls, f.name, base


LEAVES = list(numeric_leaves())


def test_the_walk_finds_the_numeric_keys_of_every_section():
    keys = {key for key, *_ in LEAVES}
    assert len(keys) >= 79
    assert {"seed", "data.seed", "actor.grad_clip", "actor.betas", "rollout.top_k",
            "rollout.spec.tokens_to_verify", "rollout.tuner.epsilon", "rollout.budget.margin",
            "algorithm.gate.quantile", "drafter.online.offset_mix", "checkpoint.stop_grace_s",
            "cluster.gpus_per_worker"} <= keys


@pytest.mark.parametrize("key, cls, name", [(k, c, n) for k, c, n, _ in LEAVES],
                         ids=[k for k, *_ in LEAVES])
def test_every_numeric_key_declares_a_range(key, cls, name):
    assert name in {r.name for r in ranged_fields(cls)}, (
        f"{key} has no Range: annotate it as Annotated[{cls.__name__}.{name}'s type, "
        "Range(...)] (fastdraft/config/sections/common.py)")
    assert key.rpartition(".")[0] == cls.SECTION, f"{cls.__name__}.SECTION: {key}'s section"


def _outside(rng: Range, is_int: bool) -> list[float]:
    """Values just outside the range's bounds (those it allows aside)."""
    out = []
    if rng.ge is not None:
        out.append(rng.ge - 1 if is_int else math.nextafter(rng.ge, -math.inf))
    if rng.gt is not None:
        out.append(rng.gt)
    if rng.le is not None:
        out.append(rng.le + 1 if is_int else math.nextafter(rng.le, math.inf))
    if rng.lt is not None:
        out.append(rng.lt)
    if is_int and rng.le is None and rng.lt is None:
        out.append(INT64_MAX + 1)       # no upper bound: still a 64-bit int
    return [v for v in out if v not in rng.allow]


def _probes(cls: type, name: str, base) -> list[str]:
    spec = next(r for r in ranged_fields(cls) if r.name == name)
    is_int = (typing.get_args(base) or (base,))[0] is int
    values = [repr(v) for v in _outside(spec.range, is_int)]
    if not is_int:
        values += ["nan", ".nan", "inf", "-inf"]
    else:
        values += ["1e400"]             # YAML's text; beyond a float
    values.append("true")
    if typing.get_origin(base) is tuple:   # one bad element is enough
        good = next(iter(typing.get_args(base)))(0)
        values = [f"[{v}, {good}]" for v in values] + [f"[{good}, {values[0]}]"]
    return values


@pytest.mark.parametrize("key, cls, name, base", LEAVES, ids=[k for k, *_ in LEAVES])
def test_a_value_outside_a_keys_range_is_one_line_naming_the_key(key, cls, name, base):
    load_recipe(TINY)                     # the recipe itself loads
    for bad in _probes(cls, name, base):
        with pytest.raises(FastdraftError) as err:
            load_recipe(TINY, [f"{key}={bad}"])
        message = str(err.value)
        assert key in message and "\n" not in message, (bad, message)
        assert " must " in message, (bad, message)


@pytest.mark.parametrize("override, message", [
    ("actor.grad_clip=-1", "actor.grad_clip must be > 0 (or null: no clipping), got -1.0"),
    ("actor.lr=true", "actor.lr must be a number, got true"),
    ("actor.lr=inf", "actor.lr must be finite and > 0, got inf"),
    ("rollout.top_k=0", "rollout.top_k must be -1 or >= 1 (-1: off), got 0"),
    ("seed=4294967296", "seed must be in [0, 2**32), got 4294967296"),
    ("actor.betas=[0.9, 1.0]", "actor.betas must each be in [0, 1), got (0.9, 1.0)"),
    ("rollout.max_batch_size=99999999999999999999",
     f"rollout.max_batch_size must be at most {INT64_MAX} (a 64-bit integer)"),
    ("seed=1.5e0", "seed must be an integer, got '1.5e0'"),
    ("data.prompt_key=yes", "data.prompt_key must be a string, got true: YAML reads yes"),
    ("logging.progress=1", "logging.progress must be true or false, got 1"),
])
def test_messages_say_the_range_and_what_was_given(override, message):
    with pytest.raises(FastdraftError) as err:
        load_recipe(TINY, [override])
    assert message in str(err.value)


def test_integral_e_notation_is_an_int_and_null_turns_clipping_off():
    cfg = load_recipe(TINY, ["seed=1e3", "rollout.max_new_tokens=2.56e2", "actor.grad_clip=null"])
    assert cfg.seed == 1000 and isinstance(cfg.seed, int)
    assert cfg.rollout.max_new_tokens == 256 and isinstance(cfg.rollout.max_new_tokens, int)
    assert cfg.actor.grad_clip is None
    assert load_recipe(TINY, ["data.prompt_key='yes'"]).data.prompt_key == "yes"


def test_the_hints_build_reads_see_through_the_ranges():
    from fastdraft.config.sections import ActorConfig, RolloutConfig
    hints = typing.get_type_hints(ActorConfig)
    assert hints["lr"] is float and hints["grad_clip"] == float | None
    assert hints["betas"] == tuple[float, float]
    assert typing.get_type_hints(RolloutConfig)["max_seq_len"] == int | None


# -- keys given twice -----------------------------------------------------------------------------

def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("name: t\nactor:\n  lr: 1.0e-5\nrollout:\n  group_size: 4\n  spec:\n    depth: 3\n"
     "actor:\n  warmup_steps: 2\n",
     "section 'actor' appears twice (lines 2 and 8): merge them into one"),
    ("name: t\nactor:\n  lr: 1.0e-5\n  warmup_steps: 1\n  lr: 2.0e-5\n",
     "key 'actor.lr' appears twice (lines 3 and 5): keep one"),
    ("rollout:\n  spec:\n    depth: 3\n  group_size: 4\n  spec:\n    topk: 2\n",
     "section 'rollout.spec' appears twice (lines 2 and 5)"),
    ("rollout:\n  spec:\n    depth: 3\n    method: eagle\n    depth: 4\n",
     "key 'rollout.spec.depth' appears twice (lines 3 and 5)"),
    ("seed: 1\nname: t\nseed: 2\n", "key 'seed' appears twice (lines 1 and 3)"),
])
def test_a_key_given_twice_names_both_lines(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(FastdraftError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"recipe {path}: {message}"), str(err.value)


def test_a_key_twice_in_an_override_value_is_refused_and_merge_keys_still_override(tmp_path):
    with pytest.raises(FastdraftError, match=r"override .*: key 'rollout\.tuner\.buckets\.1' "
                                             r"appears twice: keep one"):
        load_recipe(TINY, ["rollout.tuner.buckets={1: [off], 1: [eagle/2/2/4]}"])
    path = _write(tmp_path, "name: t\nactor: &base\n  lr: 1.0e-5\n"
                            "drafter:\n  online:\n    <<: {lr: 1.0e-3, token_budget: 512}\n"
                            "    lr: 2.0e-4\n")
    cfg = load_recipe(path)
    assert cfg.drafter.online.lr == 2e-4 and cfg.drafter.online.token_budget == 512


# -- cross-key limits -----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["rollout.group_size=1"], "set rollout.group_size >= 2"),
    (["rollout.group_size=1", "algorithm.advantage=rloo"], "algorithm.advantage=rloo"),
    (["rollout.max_seq_len=256"], "rollout.max_seq_len=256 must be > rollout.max_new_tokens=256"),
    (["rollout.spec.tokens_to_verify=49"],
     "rollout.spec.tokens_to_verify=49 is more nodes than a tree of rollout.spec.depth=6 and "
     "topk=3 holds (48"),
    (["rollout.spec.method=eagle+suffix", "rollout.spec.tokens_to_verify=55"],
     "rollout.spec.tokens_to_verify=55 is more nodes"),
    (["data.answer_key=prompt"], "data.answer_key and data.prompt_key both name the column"),
    (["rollout.tuner.buckets={1: [eagle/0/3/12]}"],
     "rollout.tuner: arm 'eagle/0/3/12': depth must be in [1, 64], got 0"),
])
def test_cross_key_limits_are_named_at_load(overrides, message):
    with pytest.raises(FastdraftError) as err:
        load_recipe(TINY, overrides)
    assert message in str(err.value)


def test_trees_at_their_limits_load():
    assert load_recipe(TINY, ["rollout.spec.tokens_to_verify=48"]).rollout.spec.tokens_to_verify \
        == 48
    merged = load_recipe(TINY, ["rollout.spec.method=eagle+suffix",
                                "rollout.spec.tokens_to_verify=54"]).rollout.spec
    assert merged.tokens_to_verify == 54
    suffix = load_recipe(TINY, ["rollout.spec.method=suffix", "drafter.online.enabled=false",
                                "rollout.spec.topk=1", "rollout.spec.tokens_to_verify=64"])
    assert suffix.rollout.spec.tokens_to_verify == 64   # a suffix tree is not topk-shaped
    assert load_recipe(TINY, ["rollout.max_seq_len=257"]).rollout.max_seq_len == 257


# -- the same through the CLI ---------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("actor.grad_clip=-1", "actor.grad_clip"),
    ("actor.grad_clip=0", "actor.grad_clip"),
    ("actor.lr=true", "actor.lr"),
    ("actor.lr=nan", "actor.lr"),
    ("actor.lr=-1e-5", "actor.lr"),
    ("actor.weight_decay=-0.1", "actor.weight_decay"),
    ("actor.betas=[0.9, 1.0]", "actor.betas"),
    ("actor.warmup_steps=-1", "actor.warmup_steps"),
    ("rollout.top_k=0", "rollout.top_k"),
    ("rollout.top_k=-7", "rollout.top_k"),
    ("rollout.temperature=inf", "rollout.temperature"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.group_size=1", "rollout.group_size"),
    ("data.task_pool=-3", "data.task_pool"),
    ("data.task_pool=0", "data.task_pool"),
    ("seed=-1", "seed"),
    ("seed=4294967296", "seed"),
    ("seed=1.5e0", "seed"),
    ("data.seed=99999999999999999999999", "data.seed"),
    ("drafter.online.offset_mix=7", "drafter.online.offset_mix"),
    ("drafter.online.tail_fraction=0", "drafter.online.tail_fraction"),
    ("rollout.max_seq_len=200", "rollout.max_new_tokens"),
    ("rollout.spec.depth=10000", "rollout.spec.depth"),
    ("rollout.spec.topk=0", "rollout.spec.topk"),
    ("rollout.spec.tokens_to_verify=0", "rollout.spec.tokens_to_verify"),
    ("rollout.spec.tokens_to_verify=49", "rollout.spec.tokens_to_verify"),
    ("data.answer_key=prompt", "data.answer_key"),
    ("data.prompt_key=no", "data.prompt_key"),
    ("cluster.connect_timeout_s=-5", "cluster.connect_timeout_s"),
    ("algorithm.gate.quantile=nan", "algorithm.gate.quantile"),
])
def test_the_cli_refuses_an_out_of_range_value_in_one_line(tmp_path, capsys, override, key):
    code = main(["run", str(TINY), override, "--dry-run", "--cache-dir", str(tmp_path / "c")])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and key in lines[0], lines
    assert "Traceback" not in captured.err + captured.out


def test_the_cli_refuses_a_recipe_with_a_section_twice(tmp_path, capsys):
    path = _write(tmp_path, TINY.read_text() + "actor:\n  lr: 1.0e-4\n")
    code = main(["run", str(path), "--dry-run", "--cache-dir", str(tmp_path / "c")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "section 'actor' appears twice (lines" in lines[0] and "merge them into one" in lines[0]
