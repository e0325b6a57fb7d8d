"""``fastdraft bootstrap``: train once and cache a tiny CPU policy, with a report of its quality.

The result lives in ``<cache>/bootstrap/<task>-<digest>/`` (``policy/`` = an HF checkpoint dir with
tokenizer and generation_config.json, plus ``report.json``); the digest covers the spec, the seed
and the format version, so a changed spec never reuses a stale policy. Everything is built in a
hidden temp dir next to it and renamed into place only when complete, so a killed run never
leaves a directory that looks like a finished bootstrap.

Training is deterministic (``determinism.py``): the report's ``weights_digest`` identifies the
trained weights bit for bit, and a forced rebuild says whether it reproduced the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from fastdraft.bootstrap.determinism import deterministic_cpu, runtime_info, weights_digest
from fastdraft.bootstrap.policy import EOS_ID, encode_prompt, heldout_problems, train_bootstrap
from fastdraft.bootstrap.spec import DEFAULT_SPEC, BootstrapSpec, get_spec
from fastdraft.bootstrap.tokenizer import BOS_TOKEN, build_char_tokenizer
from fastdraft.data.tasks import Problem, Task, get_task, length_percentiles
from fastdraft.engine import RolloutEngine, SamplingParams
from fastdraft.errors import Place, writable_dir
from fastdraft.models import save_model
from fastdraft.utils.atomic import publish_dir
from fastdraft.utils.outputs import check_output_dir

Log = Callable[[str], None]
REPORT_FILE = "report.json"
POLICY_SUBDIR = "policy"
#: Term-count buckets for accuracy by problem length (modsum prompts have 2 chars per term).
TERM_BUCKETS = ((3, 5), (6, 10), (11, 20), (21, 40))


def default_cache_dir() -> Path:
    """``$FASTDRAFT_CACHE`` if set, else ``~/.cache/fastdraft``."""
    env = os.environ.get("FASTDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fastdraft"


@dataclass(frozen=True, kw_only=True)
class BootstrapReport:
    """What a bootstrap produced and how good it is. Lengths are in tokens of the generated
    answer, EOS included (reference: solution chars + 1 for EOS), on the held-out prompts.
    ``weights_digest`` (``determinism.weights_digest``) is reproducible for the same spec and
    seed given the same ``torch_version``, ``cpu_capability`` and CPU model."""

    policy_dir: Path
    task: str
    seed: int
    spec_digest: str
    spec: dict[str, Any]
    num_params: int
    weights_digest: str
    torch_version: str
    cpu_capability: str
    train_steps: int            # over every attempt (see BootstrapSpec.restart_after)
    train_attempts: int
    train_tokens: int
    final_loss: float
    train_seconds: float
    eval_seconds: float
    total_seconds: float
    torch_threads: int
    num_heldout: int
    heldout_accuracy_greedy: float
    heldout_accuracy_sampled: float
    greedy_accuracy_by_terms: dict[str, float]
    sampled_truncated_fraction: float
    greedy_length_p50: float
    greedy_length_p90: float
    greedy_length_p99: float
    sampled_length_p50: float
    sampled_length_p90: float
    sampled_length_p99: float
    reference_length_p50: float
    reference_length_p90: float
    reference_length_p99: float
    cached: bool = field(default=False, compare=False)

    def to_json(self) -> str:
        data = asdict(self)
        data["policy_dir"] = str(self.policy_dir)
        data.pop("cached")
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, policy_dir: Path | None = None) -> BootstrapReport:
        """Parses ``to_json`` output; ``policy_dir`` overrides the stored path (cache moved)."""
        data = json.loads(text)
        data["policy_dir"] = Path(policy_dir or data["policy_dir"])
        return cls(**data)


def bootstrap_dir(cache_dir: Path, spec: BootstrapSpec, seed: int) -> Path:
    return cache_dir / "bootstrap" / f"{spec.task}-{spec.digest(seed)}"


def load_cached(result_dir: Path) -> BootstrapReport | None:
    """The report of a complete bootstrap in ``result_dir``, else None (missing or partial)."""
    policy = result_dir / POLICY_SUBDIR
    needed = [result_dir / REPORT_FILE] + [policy / name for name in (
        "config.json", "model.safetensors", "tokenizer.json", "generation_config.json")]
    if not all(p.is_file() for p in needed):
        return None
    try:
        report = BootstrapReport.from_json((result_dir / REPORT_FILE).read_text(), policy)
    except (ValueError, TypeError, KeyError):
        return None
    return BootstrapReport(**{**asdict(report), "policy_dir": policy, "cached": True})


def run_bootstrap(cache_dir: Path | None = None, force: bool = False, seed: int = 0,
                  log: Log = print, spec: BootstrapSpec | str = DEFAULT_SPEC,
                  overwrite: bool = False) -> BootstrapReport:
    """Returns the cached bootstrap for (spec, seed) or trains, evaluates and caches a new one.
    spec: a BootstrapSpec or the name of a registered one (spec.py). Its directory in the cache
    replaces only an earlier bootstrap there (anything, with `overwrite`)."""
    spec = get_spec(spec) if isinstance(spec, str) else spec
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = bootstrap_dir(cache_dir, spec, seed)
    if not force and (cached := load_cached(final)) is not None:
        log(f"bootstrap policy (cached): {cached.policy_dir}")
        return cached
    previous = load_cached(final)
    # A read-only or full cache disk, or a directory of someone else's where the policy goes,
    # is one line now, not after minutes of training.
    setting = "--cache-dir ($FASTDRAFT_CACHE)"
    check_output_dir(final, "bootstrap", f"{setting}: the bootstrap policy's directory",
                     overwrite=overwrite)
    writable_dir(Place(final.parent, setting))
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        report = _build(tmp, final, spec, seed, log)
        _publish(tmp, final, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if previous is not None:
        log(_compare_builds(previous, report))
    log(f"bootstrap policy: {report.policy_dir} (weights {report.weights_digest})")
    return report


def _compare_builds(previous: BootstrapReport, new: BootstrapReport) -> str:
    """One line: did a forced rebuild reproduce the previous build's weights bit for bit?"""
    if previous.weights_digest == new.weights_digest:
        return f"bootstrap: rebuilt weights {new.weights_digest} equal the previous build's"
    env = [f"{name} {getattr(previous, name)} -> {getattr(new, name)}"
           for name in ("torch_version", "cpu_capability", "torch_threads")
           if getattr(previous, name) != getattr(new, name)]
    return (f"bootstrap: WARNING rebuilt weights {new.weights_digest} differ from the previous "
            f"build's {previous.weights_digest} ("
            + ("; ".join(env) if env else "same torch, CPU dispatch and threads: "
               "another CPU model or MKL path, or a determinism bug") + ")")


def _publish(tmp: Path, final: Path, overwrite: bool) -> None:
    """Renames ``tmp`` onto ``final``; an existing ``final`` (forced rerun, partial leftover) is
    moved aside first. If another process published meanwhile, its complete result is kept."""
    try:
        publish_dir(tmp, final, "bootstrap", overwrite)
    except OSError:
        if load_cached(final) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _build(tmp: Path, final: Path, spec: BootstrapSpec, seed: int, log: Log) -> BootstrapReport:
    start = time.perf_counter()
    task = get_task(spec.task)
    build_char_tokenizer(tmp / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp / "tokenizer")
    heldout = heldout_problems(spec, seed)
    model, trained = train_bootstrap(spec, seed, tokenizer, log)
    num_params = sum(p.numel() for p in model.parameters())
    digest = weights_digest(model)

    policy = tmp / POLICY_SUBDIR
    save_model(model, policy, tokenizer_dir=tmp / "tokenizer")
    shutil.rmtree(tmp / "tokenizer")
    generation = {"bos_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
                  "eos_token_id": EOS_ID, "pad_token_id": tokenizer.pad_token_id,
                  "do_sample": True, "temperature": 1.0}
    (policy / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    eval_start = time.perf_counter()
    prompts = [encode_prompt(tokenizer, p.prompt) for p in heldout]
    with deterministic_cpu(spec.num_threads):
        engine = RolloutEngine(policy, max_batch_size=spec.eval_batch_size,
                               max_seq_len=spec.max_position_embeddings)
        greedy = _evaluate(engine, tokenizer, task, heldout, prompts,
                           SamplingParams(greedy=True, max_new_tokens=spec.max_new_tokens))
        sampled = _evaluate(engine, tokenizer, task, heldout, prompts,
                            SamplingParams(temperature=1.0, seed=seed,
                                           max_new_tokens=spec.max_new_tokens))
    eval_seconds = time.perf_counter() - eval_start
    ref = length_percentiles([len(tokenizer.encode(p.solution)) + 1 for p in heldout])
    report = BootstrapReport(
        policy_dir=final / POLICY_SUBDIR, task=spec.task, seed=seed,
        spec_digest=spec.digest(seed), spec=asdict(spec), num_params=num_params,
        weights_digest=digest, **runtime_info(),
        train_steps=len(trained.losses), train_attempts=trained.attempts,
        train_tokens=trained.tokens,
        final_loss=sum(trained.losses[-50:]) / len(trained.losses[-50:]),
        train_seconds=trained.seconds, eval_seconds=eval_seconds,
        total_seconds=time.perf_counter() - start, torch_threads=spec.num_threads,
        num_heldout=len(heldout), heldout_accuracy_greedy=greedy.accuracy,
        heldout_accuracy_sampled=sampled.accuracy,
        greedy_accuracy_by_terms=_accuracy_by_terms(heldout, greedy.correct),
        sampled_truncated_fraction=sampled.truncated_fraction,
        **_prefixed("greedy_length", greedy.length_percentiles),
        **_prefixed("sampled_length", sampled.length_percentiles),
        **_prefixed("reference_length", ref))
    (tmp / REPORT_FILE).write_text(report.to_json())
    log(f"bootstrap: greedy acc {greedy.accuracy:.3f} sampled acc {sampled.accuracy:.3f} "
        f"by terms {report.greedy_accuracy_by_terms}; train {trained.seconds:.0f}s "
        f"eval {eval_seconds:.0f}s total {report.total_seconds:.0f}s")
    return report


@dataclass(frozen=True, slots=True)
class _Eval:
    correct: list[bool]
    lengths: list[int]
    truncated_fraction: float

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)

    @property
    def length_percentiles(self) -> dict[str, float]:
        return length_percentiles(self.lengths)


def _evaluate(engine: RolloutEngine, tokenizer: Any, task: Task, problems: Sequence[Problem],
              prompts: list[list[int]], params: SamplingParams) -> _Eval:
    completions = engine.generate(prompts, params, use_tqdm=False)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    correct = [task.reward(p, t) == 1.0 for p, t in zip(problems, texts, strict=True)]
    truncated = sum(c.finish_reason.value == "length" for c in completions) / len(completions)
    return _Eval(correct, [len(c.token_ids) for c in completions], truncated)


def _accuracy_by_terms(problems: Sequence[Problem], correct: Sequence[bool]) -> dict[str, float]:
    """Greedy accuracy per term-count bucket (empty buckets omitted): shows the drop on long
    problems. A modsum prompt of n terms has 2n characters."""
    out: dict[str, float] = {}
    for lo, hi in TERM_BUCKETS:
        hits = [c for p, c in zip(problems, correct, strict=True) if lo <= len(p.prompt) // 2 <= hi]
        if hits:
            out[f"{lo}-{hi}"] = round(sum(hits) / len(hits), 4)
    return out


def _prefixed(prefix: str, percentiles: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}_{k}": v for k, v in percentiles.items()}
