"""fastdraft: lossless speculative rollouts for RL post-training."""

from fastdraft.engine import Completion, FinishReason, RolloutEngine, SamplingParams

__version__ = "0.1.0"
__all__ = ["Completion", "FinishReason", "RolloutEngine", "SamplingParams", "__version__"]
