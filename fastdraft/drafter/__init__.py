from fastdraft.drafter import eagle1, eagle3  # noqa: F401  (register the drafter kinds)
from fastdraft.drafter.base import DRAFTERS, Drafter, build_drafter
from fastdraft.drafter.checkpoint import load_drafter, save_drafter

__all__ = ["DRAFTERS", "Drafter", "build_drafter", "load_drafter", "save_drafter"]
