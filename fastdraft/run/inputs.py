"""What a run is built from, checked and resolved before any work (run/preflight.py calls them in
order): the recipe's local paths and devices, the policy's files and tokenizer (the bootstrap
policy when none is given), the drafter (one warmed up for the bootstrap policy), and the
sequence length rollouts need."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from fastdraft.config import RunConfig
from fastdraft.errors import FastdraftError

#: Files of which a checkpoint's tokenizer needs one (besides tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_paths(cfg: RunConfig) -> None:
    """Every local path the recipe names, checked before any work: one error lists them all."""
    missing = []
    for key, value, want in (("model.path", cfg.model.path, "config.json"),
                             ("data.path", cfg.data.path, None),
                             ("drafter.path", cfg.drafter.path, None)):
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.exists() or (want is not None and not (path / want).is_file()):
            missing.append(f"{key}: {path}" + (f" (no {want})" if path.exists() else ""))
    if missing:
        raise FileNotFoundError("the recipe names paths that do not exist: " + "; ".join(
            missing) + " (edit the recipe or override, e.g. model.path=/local/checkpoint)")


def check_devices(cfg: RunConfig) -> None:
    """A CUDA device the recipe names must exist in this torch build, checked before any work
    (torch's own error is an assertion deep inside the first allocation)."""
    for key, device in (("model.device", cfg.model.device),
                        ("drafter.online.device", cfg.drafter.online.device)):
        if device is None or torch.device(device).type != "cuda":
            continue
        if not torch.cuda.is_available():
            build = (f"this torch ({torch.__version__}) is a CPU build" if torch.version.cuda
                     is None else f"this torch ({torch.__version__}) sees no CUDA device")
            raise FastdraftError(f"{key}={device}, but {build}: replace it with a CUDA build "
                                 "(.venv/bin/pip uninstall -y torch && FASTDRAFT_TORCH=torch "
                                 "FASTDRAFT_TORCH_INDEX=https://download.pytorch.org/whl/cu126 "
                                 f"bash scripts/setup.sh; README: Run on a GPU) or set {key}=cpu")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise FastdraftError(f"{key}={device}, but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")


def resolve_policy(cfg: RunConfig, cache_dir: Path | None) -> Path:
    """The recipe's checkpoint directory, or the bootstrap policy of model.bootstrap (trained
    once, cached)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path}: no config.json there; point it at a "
                                    "local HF checkpoint directory")
        return path
    from fastdraft.bootstrap.run import run_bootstrap
    return run_bootstrap(cache_dir, spec=cfg.model.bootstrap).policy_dir


def check_policy_files(cfg: RunConfig) -> None:
    """model.path holds a checkpoint fastdraft runs: config.json of a supported architecture
    (said first: nothing else matters for one it cannot run), a tokenizer, weight files that
    are whole and hold every weight of its shape in a float dtype (their headers; nothing is
    loaded), and as many positions as the run's sequences take."""
    if cfg.model.path is None:
        return
    from fastdraft.models import ModelConfig
    from fastdraft.models.loading import check_weight_headers
    path = Path(cfg.model.path).expanduser()
    try:
        model_config = ModelConfig.from_pretrained(path)
    except (ValueError, KeyError) as err:   # KeyError: a key every supported config has
        what = f"no {err} in it" if isinstance(err, KeyError) else str(err)
        raise FastdraftError(f"model.path {path}: {what}") from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FastdraftError(
            f"model.path {path}: no tokenizer files there (one of {', '.join(TOKENIZER_FILES)}):"
            " copy them from the checkpoint the weights came from")
    check_weight_headers(path, model_config, "model.path")
    longest = rollout_seq_len(cfg)
    if longest > model_config.max_position_embeddings and not cfg.model.extend_positions:
        raise FastdraftError(
            f"the run's sequences reach {longest} tokens (rollout.max_seq_len, or the longest "
            f"prompt + rollout.max_new_tokens), past model.path's max_position_embeddings "
            f"{model_config.max_position_embeddings} (its config.json): lower "
            "rollout.max_new_tokens / rollout.max_seq_len, use a policy made for longer "
            "sequences, or set model.extend_positions=true to run it past its length")


def load_tokenizer(policy_dir: Path, setting: str) -> Any:
    """The policy's tokenizer, proven to turn text into tokens (transformers builds an empty
    one, silently, for a directory without its files)."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    except (OSError, ValueError) as err:
        raise FastdraftError(f"{setting} {policy_dir}: its tokenizer does not load "
                             f"({type(err).__name__}: {str(err)[:200]})") from None
    if not tokenizer.encode("1 + 2 = 3", add_special_tokens=False):
        raise FastdraftError(f"{setting} {policy_dir}: its tokenizer turns text into no tokens: "
                             "the directory lacks its tokenizer files (tokenizer.json, ...)")
    return tokenizer


def check_drafter_source(cfg: RunConfig) -> None:
    """An EAGLE recipe has a drafter: drafter.path (written by `fastdraft drafter warmup` or an
    engine directory: SpecForge/SGLang or speculators layout, its weights whole), or the one
    the run warms up for the bootstrap policy."""
    if not cfg.rollout.spec.uses_drafter:
        return
    if cfg.drafter.path is not None:
        from fastdraft.drafter.checkpoint import WEIGHTS_FILE
        from fastdraft.utils.tensor_file import check_safetensors
        path = Path(cfg.drafter.path).expanduser()
        if not any((path / name).is_file() for name in ("drafter_config.json", "config.json")):
            raise FileNotFoundError(
                f"drafter.path {path}: neither drafter_config.json (a drafter fastdraft wrote) "
                "nor config.json (a SpecForge/SGLang or speculators EAGLE-3 directory) there")
        if (path / WEIGHTS_FILE).is_file():
            check_safetensors(path / WEIGHTS_FILE, "drafter.path")
        return
    if cfg.model.path is not None:
        policy = Path(cfg.model.path).expanduser()
        raise FastdraftError(
            f"rollout.spec.method={cfg.rollout.spec.method} needs drafter.path for a policy of "
            f"your own: train one with `fastdraft drafter warmup --policy {policy}`, or use "
            "rollout.spec.method=suffix drafter.online.enabled=false (no training needed)")


def resolve_drafter(cfg: RunConfig, policy_dir: Path, import_dir: Path | None = None
                    ) -> Path | None:
    """The drafter of an EAGLE recipe: drafter.path (an engine directory imported into
    `import_dir`, default beside the policy's cache, as a fastdraft checkpoint), or for the
    bootstrap policy one warmed up with the recipe's settings (cached beside the policy)."""
    if not cfg.rollout.spec.uses_drafter:
        return None
    check_drafter_source(cfg)
    if cfg.drafter.path is not None:
        path = Path(cfg.drafter.path).expanduser()
        from fastdraft.export.imports import engine_layout, import_drafter
        if engine_layout(path) is None:
            return path
        out = import_dir if import_dir is not None else _default_import_dir(path)
        import_drafter(path, policy_dir, out)
        print(f"drafter.path {path} ({engine_layout(path)} layout) imported into {out}")
        return out
    from fastdraft.demo import ensure_drafter
    return ensure_drafter(policy_dir, None, warmup=recipe_warmup(cfg))


def recipe_warmup(cfg: RunConfig):
    """The warm-up a run gives the bootstrap policy's drafter (drafter.kind, warmup_steps,
    warmup_rollouts)."""
    from fastdraft.drafter.warmup import WarmupConfig
    return WarmupConfig(kind=cfg.drafter.kind, steps=cfg.drafter.warmup_steps,
                        num_rollouts=cfg.drafter.warmup_rollouts)


def _default_import_dir(source: Path) -> Path:
    from hashlib import sha256

    from fastdraft.bootstrap.run import default_cache_dir
    key = sha256(str(source.resolve()).encode()).hexdigest()[:16]
    return default_cache_dir() / "imported-drafters" / key


def recipe_prompts(cfg: RunConfig, policy_dir: Path, n: int) -> list[list[int]]:
    """n of the recipe's prompts as its run tokenizes them (data.task or data.path with its
    prompt_key and add_special_tokens): the drafter warm-up's `--recipe`."""
    from fastdraft.data.prompts import PromptSource
    rows = None
    if cfg.data.path is not None:
        from fastdraft.data.files import load_prompts
        rows = load_prompts(Path(cfg.data.path).expanduser(), cfg.data.prompt_key,
                            cfg.data.answer_key)
    tokenizer = load_tokenizer(policy_dir, "model.path" if cfg.model.path else "the policy")
    max_len = rollout_seq_len(cfg) - cfg.rollout.max_new_tokens
    return [item.ids for item in PromptSource(cfg.data, tokenizer, max_len, rows).batch(0, n)]


def rollout_seq_len(cfg: RunConfig) -> int:
    """rollout.max_seq_len, or the longest prompt a task draws (over many samples) + the
    answer budget."""
    if cfg.rollout.max_seq_len:
        return cfg.rollout.max_seq_len
    from fastdraft.data.tasks import get_task
    if cfg.data.task is None:
        raise FastdraftError("rollout.max_seq_len must be set for prompt files")
    task = get_task(cfg.data.task, **cfg.data.task_options)
    longest = getattr(task, "max_prompt_chars", None)
    if longest is None:
        rng = random.Random(0)
        longest = 2 * max(len(task.sample(rng).prompt) for _ in range(4096))
    return longest + cfg.rollout.max_new_tokens + 8
