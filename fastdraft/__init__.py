"""fastdraft: lossless speculative rollouts for RL post-training.

    from fastdraft import RolloutEngine, SamplingParams, SpecConfig     # the rollout engine
    from fastdraft import TunerConfig, BudgetConfig                     # per-step speculation
    from fastdraft import RunConfig, load_recipe, run_recipe            # the GRPO main job
"""

from fastdraft.config import RunConfig, load_recipe
from fastdraft.config.engine import BudgetConfig, SpecConfig, TunerConfig
from fastdraft.engine import Completion, FinishReason, RolloutEngine, SamplingParams
from fastdraft.engine.buckets import BucketPlan

__version__ = "0.1.0"
__all__ = ["BucketPlan", "BudgetConfig", "Completion", "FinishReason", "RolloutEngine", "RunConfig",
           "SamplingParams", "SpecConfig", "TunerConfig", "__version__", "load_recipe",
           "run_recipe"]


def run_recipe(*args, **kwargs):
    """fastdraft.run.run.run_recipe: one GRPO run from a RunConfig (see `fastdraft run`)."""
    from fastdraft.run.run import run_recipe as run
    return run(*args, **kwargs)
