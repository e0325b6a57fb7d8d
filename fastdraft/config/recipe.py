"""YAML recipes <-> RunConfig. Keys map 1:1 onto the dataclass fields; an unknown key is an error
that names the closest valid one; `section.key=value` overrides (command line) apply before the
sections are built, so they are checked the same way. Values are coerced to the field's type
(YAML reads `3e-6` as a string, for one); a key given twice in one mapping is refused (YAML
would keep the last and drop the first without a word)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from fastdraft.config.sections import RunConfig
from fastdraft.errors import FastdraftError
from fastdraft.utils.atomic import atomic_write_text

#: Keys that existed once: a recipe that still has one is told what replaced it.
REMOVED_KEYS = {
    "actor.deepspeed": "the actor shards itself with FSDP2 over actor.num_ranks processes "
                       "(fp32 masters, actor.compute_dtype compute); DeepSpeed is not offered: "
                       "delete the actor.deepspeed section",
    "actor.mixed_precision": "use actor.compute_dtype: bfloat16 | float16 | float32 (the "
                             "actor always keeps fp32 master weights)",
    "algorithm.logprob_tolerance": "the lossless gate's limits are the algorithm.gate section "
                                   "(mean_tolerance, quantile_tolerance, max_tolerance, max_share, "
                                   "law_z_threshold, law_bias_tolerance; unset: from "
                                   "model.dtype and actor.compute_dtype)",
}


def load_recipe(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """A recipe file (None: all defaults) plus `a.b.c=value` overrides -> a checked RunConfig."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_recipe(Path(path))
    for item in overrides:
        _apply_override(data, item)
    return build(RunConfig, data, "")


def _read_recipe(file: Path) -> dict[str, Any]:
    """The recipe file's sections; a directory, an empty (or comment-only) file or a file that is
    not a mapping is a user error: running all the defaults is never what was meant."""
    if file.is_dir():
        found = sorted(p.name for p in file.glob("*.yaml"))
        listed = f": it holds {', '.join(found)}" if found else ""
        raise FastdraftError(f"recipe {file} is a directory: name a YAML file in it{listed} "
                             f"(e.g. fastdraft run {file / (found[0] if found else 'NAME.yaml')})")
    if not file.is_file():
        raise FileNotFoundError(f"recipe {file} not found (bundled ones are in recipes/)")
    try:
        data = _load_yaml(file.read_text(), f"recipe {file}")
    except yaml.YAMLError as err:
        raise FastdraftError(f"recipe {file} is not valid YAML: {err}") from None
    if data is None:
        raise FastdraftError(f"recipe {file} is empty (or only comments): a recipe names at least "
                             "its sections; start from a bundled one, e.g. recipes/tiny-grpo.yaml")
    if not isinstance(data, dict):
        raise FastdraftError(f"recipe {file} must be a mapping of sections, got "
                             f"{type(data).__name__}")
    return data


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise FastdraftError(f"override {item!r} is not KEY=VALUE (e.g. actor.lr=3e-6)")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise FastdraftError(f"override {item!r}: {part!r} is not a section")
        node = child
    try:
        value = _load_yaml(raw, f"override {item!r}", key.strip(), lines=False) \
            if raw.strip() else None
    except yaml.YAMLError as err:
        raise FastdraftError(f"override {item!r}: the value is not valid YAML: {err}") from None
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping, at any depth (a section
    twice, a key twice inside one): PyYAML keeps the last and drops the first silently. The
    error names `label` (the file or override), the dotted key and both lines."""

    where_label = "recipe"
    key_prefix = ""
    with_lines = True

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_unique(node, self.key_prefix, set())
        return super().construct_document(node)

    def _check_unique(self, node: yaml.Node, where: str, seen: set[int]) -> None:
        if id(node) in seen:       # an alias of a node already checked
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique(item, f"{where}[{i}]", seen)
            return
        if not isinstance(node, yaml.MappingNode):
            return
        first: dict[Any, yaml.Node] = {}
        children = []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":   # `<<: *base`: overriding is its job
                continue
            try:
                key = self.construct_object(key_node, deep=True)
                hash(key)
            except (yaml.YAMLError, TypeError):
                continue            # an unhashable key: construction says what is wrong
            name = _join(where, str(key))
            if key in first:
                section = isinstance(value_node, yaml.MappingNode)
                at = (f" (lines {first[key].start_mark.line + 1} and "
                      f"{key_node.start_mark.line + 1})" if self.with_lines else "")
                raise FastdraftError(
                    f"{self.where_label}: {'section' if section else 'key'} {name!r} appears "
                    f"twice{at}: {'merge them into one' if section else 'keep one'}")
            first[key] = key_node
            children.append((value_node, name))
        for value_node, name in children:   # this level's keys first, then each section's
            self._check_unique(value_node, name, seen)


def _load_yaml(text: str, label: str, prefix: str = "", lines: bool = True) -> Any:
    """yaml.safe_load, refusing duplicate keys (named under `prefix`, e.g. an override's key)."""
    loader = _UniqueKeyLoader(text)
    loader.where_label, loader.key_prefix, loader.with_lines = label, prefix, lines
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def build(cls: type, data: Any, where: str, base: Any = None) -> Any:
    """Builds dataclass `cls` from a mapping, recursively; `where` names the section in errors.
    Keys the mapping leaves out keep the values of `base` (the section's default instance), so
    `rollout.spec.method=none` changes the method and keeps the recipe's tree shape."""
    if not isinstance(data, dict):
        raise FastdraftError(f"{where or 'recipe'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    if base is None:
        base = _default_instance(cls)
    kwargs = {} if base is None else {f: getattr(base, f) for f in fields}
    for key, value in data.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields and name in REMOVED_KEYS:
            raise FastdraftError(f"recipe key {name!r} was removed: {REMOVED_KEYS[name]}")
        if key not in fields:
            raise FastdraftError(f"unknown recipe key {name!r}{_did_you_mean(cls, where, key)} "
                                 f"(valid keys here: {', '.join(sorted(fields))})")
        kwargs[key] = _coerce(hints[key], value, name,
                              None if base is None else getattr(base, key))
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise FastdraftError(f"{where or 'recipe'}: {err}") from None


def _did_you_mean(cls: type, where: str, key: str) -> str:
    """`; did you mean 'x.y'?`: a close key of this section, else a key of that name (or close
    to it) in another section of the recipe (`group_size` -> `rollout.group_size`)."""
    close = difflib.get_close_matches(str(key), [f.name for f in dataclasses.fields(cls)], n=1)
    if close:
        return f"; did you mean {_join(where, close[0])!r}?"
    keys = list(_all_keys(RunConfig, ""))
    leaves: dict[str, list[str]] = {}
    for dotted in keys:
        leaves.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    names = leaves.get(str(key)) or [d for near in difflib.get_close_matches(str(key), leaves, n=1)
                                     for d in leaves[near]]
    if not names:
        return ""
    return "; did you mean " + " or ".join(repr(n) for n in names) + "?"


def _all_keys(cls: type, where: str) -> Iterator[str]:
    """Every dotted key of a config class, sections and their keys."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = _join(where, f.name)
        yield name
        inner = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],))
                 if dataclasses.is_dataclass(a)]
        for section in inner:
            yield from _all_keys(section, name)


def _default_instance(cls: type) -> Any:
    try:
        return cls()
    except (TypeError, ValueError):  # a section without complete defaults
        return None


def _coerce(hint: Any, value: Any, name: str, current: Any = None) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, name, current) if len(inner) == 1 else value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, name, current if dataclasses.is_dataclass(current) else None)
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise FastdraftError(f"{name} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, name) for a, v in zip(args, value))
    if (origin or hint) is dict and value is None:   # null clears a mapping setting
        return {}
    if hint is bool:
        if not isinstance(value, bool):
            raise FastdraftError(f"{name} must be true or false, got {value!r}")
        return value
    if hint in (int, float):
        return _number(hint, value, name)
    if hint is str:
        if isinstance(value, bool):
            raise FastdraftError(
                f"{name} must be a string, got {_yaml_word(value)}: YAML reads yes / no / on / "
                "off / true / false unquoted as a boolean; quote the value (in a recipe "
                "key: \"yes\", on the command line key='\"yes\"')")
        if not isinstance(value, str | int | float):
            raise FastdraftError(f"{name} must be a string, got {value!r}")
        return str(value)
    return value


def _number(hint: type, value: Any, name: str) -> int | float:
    """value as an int or float field takes it: a bool is not a number (YAML reads yes / true as
    one), '3e-6' (YAML 1.1 reads e-notation without a dot as text) is, and an integral one
    ('1e3', 1000.0) is an int; the field's Range then says what it may be."""
    if isinstance(value, bool):
        raise FastdraftError(f"{name} must be a number, got {_yaml_word(value)}")
    number: Any = value
    if isinstance(value, str):
        try:
            number = int(value.strip()) if hint is int else float(value)
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                raise FastdraftError(f"{name} must be a number, got {value!r}") from None
    elif not isinstance(value, int | float):
        raise FastdraftError(f"{name} must be a number, got {value!r}")
    if hint is float:
        try:
            return float(number)
        except OverflowError:      # an int beyond any float
            raise FastdraftError(f"{name} is out of range: {value!r} is beyond the largest "
                                 "float") from None
    if isinstance(number, float):
        if not math.isfinite(number):
            raise FastdraftError(f"{name} must be a finite integer, got {value!r}")
        if not number.is_integer():
            raise FastdraftError(f"{name} must be an integer, got {value!r}")
        number = int(number)
    return number


def _yaml_word(value: bool) -> str:
    return "true" if value else "false"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data (tuples as lists): what a run directory records."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Writes the resolved config as YAML (atomically); load_recipe reads it back."""
    atomic_write_text(path, yaml.safe_dump(config_dict(cfg), sort_keys=False))
