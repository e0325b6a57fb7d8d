"""Local prompt datasets: load JSONL / parquet prompt files, write JSONL atomically.

Real recipes read prompts from local files through ``datasets``' packaged json and parquet
builders. Only local paths are accepted, and the files are read with ``Dataset.from_json`` /
``Dataset.from_parquet`` (the same builders ``load_dataset("json", data_files=...)`` runs) because
``load_dataset`` also pings the hub to count downloads unless HF_HUB_OFFLINE is set; this way
loading never touches the network, whatever the environment says. Rows come back as plain
dicts with canonical ``prompt`` (and ``answer``) keys so the RL loop does not care how the user
named the columns.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fastdraft.utils.atomic import atomic_write_text

#: File suffix -> ``datasets`` builder name.
SUPPORTED_SUFFIXES: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_prompts(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    split: str = "train",
) -> list[dict[str, Any]]:
    """Load prompt rows from a local ``.jsonl``/``.json``/``.parquet`` file.

    Each row keeps all its columns and gains ``"prompt"`` (= ``row[prompt_key]``) and, when
    ``answer_key`` is given, ``"answer"`` (= ``row[answer_key]``); these overwrite columns of the
    same name. ``split`` names the split the file is loaded as (one file = one split).
    """
    file = Path(path)
    builder = SUPPORTED_SUFFIXES.get(file.suffix.lower())
    if builder is None:
        raise ValueError(
            f"unsupported prompt file {str(file)!r}: use one of {sorted(SUPPORTED_SUFFIXES)}"
        )
    if not file.is_file():
        raise FileNotFoundError(f"prompt file not found: {str(file)!r}")

    try:  # deferred: importing datasets costs ~1 s and only this function needs it
        import datasets
    except ImportError as err:
        raise ImportError("loading prompt files needs the `datasets` package (a fastdraft "
                          "dependency): pip install 'datasets>=3.0'") from err

    if file.stat().st_size == 0:
        raise ValueError(f"prompt file {str(file)!r} is empty: it needs one row per prompt")
    read = getattr(datasets.Dataset, f"from_{builder}")  # from_json / from_parquet
    try:
        dataset = read(str(file), split=split)
    except (Exception, StopIteration) as err:  # datasets' own errors bury the cause in chains
        cause = err
        while cause.__cause__ is not None:
            cause = cause.__cause__
        shape = ("one JSON object per line" if builder == "json" else "a parquet table")
        raise ValueError(f"prompt file {str(file)!r} could not be read as {shape}: "
                         f"{type(cause).__name__}: {str(cause)[:200]}") from None
    columns = list(dataset.column_names)
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if key is not None and key not in columns:
            raise ValueError(
                f"{role}={key!r} is not a column of {str(file)!r}: available columns {columns}"
            )
    if len(dataset) == 0:
        raise ValueError(f"prompt file {str(file)!r} has no rows")
    rows: list[dict[str, Any]] = []
    for row in dataset:
        out = dict(row)
        out["prompt"] = row[prompt_key]
        if answer_key is not None:
            out["answer"] = row[answer_key]
        rows.append(out)
    return rows


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str | Path) -> None:
    """Write ``rows`` as JSON lines, atomically: readers see the old file or the whole new one.

    Writes a temporary file in the destination directory (same filesystem, so ``os.replace`` is
    atomic), fsyncs it, then renames it over ``path``. Parent directories are created.
    """
    atomic_write_text(path, "".join(json.dumps(dict(row), ensure_ascii=False) + "\n"
                                    for row in rows))
