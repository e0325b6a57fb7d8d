from fastdraft.drafter import eagle1, eagle3  # noqa: F401  (register the drafter kinds)
from fastdraft.drafter.base import DRAFTERS, Drafter, build_drafter, drafter_layer_config
from fastdraft.drafter.checkpoint import load_drafter, save_drafter
from fastdraft.drafter.layout import LayerLayout

__all__ = ["DRAFTERS", "Drafter", "LayerLayout", "build_drafter", "drafter_layer_config",
           "load_drafter", "save_drafter"]
