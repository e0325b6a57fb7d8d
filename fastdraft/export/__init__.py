"""Exporting a trained fastdraft drafter in the formats SGLang and vLLM load as EAGLE drafters
(see docs/export-formats.md for the rules each engine applies)."""

from fastdraft.export.check import check_export
from fastdraft.export.formats import FORMATS, ExportFormat, export_dirs
from fastdraft.export.reload import load_exported_drafter
from fastdraft.export.writer import export_drafter

__all__ = ["FORMATS", "ExportFormat", "check_export", "export_dirs", "export_drafter",
           "load_exported_drafter"]
