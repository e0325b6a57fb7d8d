from fastdraft.engine.engine import RolloutEngine
from fastdraft.engine.request import Completion, FinishReason
from fastdraft.engine.sampling_params import SamplingParams

__all__ = ["Completion", "FinishReason", "RolloutEngine", "SamplingParams"]
