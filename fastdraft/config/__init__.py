"""Run configuration: frozen dataclass sections (config/sections.py), built from YAML recipes with
dotted command-line overrides (config/recipe.py)."""

from fastdraft.config.recipe import dump_config, load_recipe
from fastdraft.config.sections import RunConfig

__all__ = ["RunConfig", "dump_config", "load_recipe"]
