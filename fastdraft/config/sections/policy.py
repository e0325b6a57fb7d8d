"""The policy and the prompts: `model` and `data` sections of a run."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from fastdraft.config.sections.common import DTYPES, SEED_RANGE, Range, check_ranges
from fastdraft.config.sections.common import require as _require
from fastdraft.errors import FastdraftError


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
    """The policy. path: an HF checkpoint directory; None = the bootstrap policy named by
    bootstrap (fastdraft/bootstrap/spec.py: tiny = the Qwen2 of the tiny CPU recipe, tiny-qwen3
    = a Qwen3 with head_dim 64), trained once and cached. extend_positions: a model.path policy
    may serve and train sequences longer than its config.json's max_position_embeddings (the
    engine and the actor extend its rotary table alike; what it does past its trained length is
    its own); without it such a run is refused before any work. The bootstrap policies are
    made to run past the 256 positions they trained on."""

    SECTION: ClassVar[str] = "model"

    path: str | None = None
    bootstrap: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    extend_positions: bool = False

    def __post_init__(self) -> None:
        check_ranges(self)
        _require(re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                 f"model.device must be cpu, cuda or cuda:N, got {self.device!r}")
        _require(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        from fastdraft.bootstrap.spec import BOOTSTRAP_SPECS  # the registry, when checked
        _require(self.bootstrap in BOOTSTRAP_SPECS, f"model.bootstrap must be one of "
                 f"{BOOTSTRAP_SPECS.names()} (a bootstrap policy's spec), got {self.bootstrap!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Prompts and their reward. task: problems drawn from a registered task (its verifier is
    the reward): fresh ones every step, or task_pool of them drawn once and visited epoch by
    epoch like a dataset; or path: a local parquet / JSONL file with prompt and answer columns,
    scored by the registered `reward`."""

    SECTION: ClassVar[str] = "data"

    task: str | None = "modsum"
    task_options: dict[str, Any] = field(default_factory=dict)  # the task's own settings
    # a dataset of this many task problems, visited in epochs; None: fresh ones every step
    task_pool: Annotated[int | None, Range(ge=1, note="fresh problems every step")] = None
    path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward: str = "math"
    add_special_tokens: bool | None = None  # None: no for task prompts, yes for file prompts
    seed: Annotated[int, SEED_RANGE] = 0

    def __post_init__(self) -> None:
        check_ranges(self)
        _require((self.task is None) != (self.path is None),
                 "data: set exactly one of data.task (a built-in task) and data.path (a local "
                 "parquet / JSONL file)")
        _require(self.answer_key != self.prompt_key, f"data.answer_key and data.prompt_key "
                 f"both name the column {self.prompt_key!r}: the answer would be the prompt; "
                 "name the answer's own column")
        _require(isinstance(self.task_options, dict), "data.task_options must be a mapping of "
                 f"the task's options (e.g. max_terms: 40), got {self.task_options!r}")
        from fastdraft.data.rewards import available_rewards
        _require(self.reward in available_rewards(), f"data.reward: unknown reward "
                 f"{self.reward!r}: choose one of {available_rewards()} (or register yours with "
                 "fastdraft.data.rewards.register_reward)")
        if self.task is None:
            _require(not self.task_options and self.task_pool is None,
                     "data.task_options and data.task_pool belong to data.task: with data.path "
                     "they would be ignored; remove them (from the command line: "
                     "data.task_options=null data.task_pool=null)")
        else:   # an unknown task or option fails when the recipe loads, not after a bootstrap
            from fastdraft.data.tasks import get_task
            try:
                get_task(self.task, **self.task_options)
            except ValueError as err:
                raise FastdraftError(f"data.task / data.task_options: {err}") from None


