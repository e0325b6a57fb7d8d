"""Local prompt datasets: load JSONL / parquet prompt files, write JSONL atomically.

Real recipes read prompts from local files through ``datasets``' packaged json and parquet
builders. Only local paths are accepted, and the files are read with ``Dataset.from_json`` /
``Dataset.from_parquet`` (the same builders ``load_dataset("json", data_files=...)`` runs) because
``load_dataset`` also pings the hub to count downloads unless HF_HUB_OFFLINE is set; this way
loading never touches the network, whatever the environment says. Rows come back as plain
dicts with canonical ``prompt`` (and ``answer``) keys so the RL loop does not care how the user
named the columns. Every row's prompt and answer are checked as text (data/checks.py). The
file is read into memory each time, nothing left in the datasets cache.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fastdraft.data.checks import check_text_column, first_bad_json_line
from fastdraft.errors import FastdraftError
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
        raise FastdraftError(
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
        raise FastdraftError(f"prompt file {str(file)!r} is empty: it needs one row per prompt")
    if builder == "json":
        _check_json_text(file)
    else:
        _check_parquet_columns(file)
    read = getattr(datasets.Dataset, f"from_{builder}")  # from_json / from_parquet
    try:   # in memory, its Arrow copy in a directory that goes: no cache grows per file version
        with _quiet(datasets), tempfile.TemporaryDirectory(prefix="fastdraft-prompts-") as tmp:
            dataset = read(str(file), split=split, cache_dir=tmp, keep_in_memory=True)
    except (Exception, StopIteration) as err:  # datasets' own errors bury the cause in chains
        raise _unreadable(file, builder, err) from None
    columns = list(dataset.column_names)
    for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if key is not None and key not in columns:
            raise FastdraftError(
                f"{role}={key!r} is not a column of {str(file)!r}: available columns {columns}"
            )
    if len(dataset) == 0:
        raise FastdraftError(f"prompt file {str(file)!r} has no rows")
    check_text_column(dataset.data, file, prompt_key, "prompt")
    if answer_key is not None:
        check_text_column(dataset.data, file, answer_key, "answer")
    rows: list[dict[str, Any]] = dataset.to_list()
    for row in rows:
        row["prompt"] = row[prompt_key]
        if answer_key is not None:
            row["answer"] = row[answer_key]
    return rows


def _check_json_text(file: Path) -> None:
    """A JSON file is UTF-8 text (JSON's own rule) with at least one row; another encoding is
    named with the line and byte where it shows."""
    content, line = False, 1
    with file.open("rb") as f:   # line by line: a large file is never held twice
        for raw in f:
            try:
                content = raw.decode("utf-8").strip() != "" or content
            except UnicodeDecodeError as err:
                raise FastdraftError(
                    f"prompt file {str(file)!r} is not UTF-8 text: line {line} has the byte "
                    f"0x{raw[err.start]:02x}, which UTF-8 does not allow there (Latin-1 / "
                    "cp1252?): re-save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 FILE > NEW`"
                    ) from None
            line += 1
    if not content:
        raise FastdraftError(f"prompt file {str(file)!r} holds only blank lines: it needs one "
                             "row (a JSON object) per prompt")


def _check_parquet_columns(file: Path) -> None:
    """A parquet table's column names are unique (a reader would pick one of two silently)."""
    import pyarrow.parquet as pq
    try:
        names = pq.read_schema(file).names
    except Exception:   # not parquet at all: the reader says so below
        return
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise FastdraftError(f"prompt file {str(file)!r} has the column(s) {twice} more than "
                             "once: rename or drop the duplicates")


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No progress bar and no logged error while a file loads: a failure is told as one line
    (its logged twin would come first, with a traceback)."""
    logging, bars = datasets.utils.logging, datasets.utils.logging.is_progress_bar_enabled()
    level = logging.get_verbosity()
    datasets.disable_progress_bars()
    logging.set_verbosity(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _unreadable(file: Path, builder: str, err: BaseException) -> FastdraftError:
    """The reader's failure as one line: a JSON Lines file's first bad line, else the root
    cause of the error `datasets` raised."""
    if builder == "json" and file.suffix.lower() == ".jsonl":
        bad_line = first_bad_json_line(file)
        if bad_line is not None:
            return FastdraftError(f"prompt file {str(file)!r}: {bad_line}: every line must be "
                                  "one JSON object (a row); fix or drop that line")
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    shape = "one JSON object per line" if builder == "json" else "a parquet table"
    first = (str(cause).strip().splitlines() or [""])[0]   # one line, not a dumped schema
    return FastdraftError(f"prompt file {str(file)!r} could not be read as {shape}: "
                          f"{type(cause).__name__}: {first[:200]}")


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str | Path) -> None:
    """Write ``rows`` as JSON lines, atomically: readers see the old file or the whole new one.

    Writes a temporary file in the destination directory (same filesystem, so ``os.replace`` is
    atomic), fsyncs it, then renames it over ``path``. Parent directories are created.
    """
    atomic_write_text(path, "".join(json.dumps(dict(row), ensure_ascii=False) + "\n"
                                    for row in rows))
