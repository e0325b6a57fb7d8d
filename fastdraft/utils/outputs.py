"""Outputs never replace what fastdraft did not write.

Every directory fastdraft publishes or creates for a user carries a marker file (MARKER, JSON
`{"kind": ...}`) naming what it holds: a run directory, a drafter, an export, a bootstrap
policy, a checkpoint, a warm-up's work directory. A file fastdraft writes for a user (a bench's
or a dry run's JSON, a dashboard PNG) carries it inside: a top-level `"fastdraft"` key in JSON,
a `Software: fastdraft ...` text chunk in a PNG. An output path may be replaced only when it is
absent, an empty directory, or fastdraft's own output of the same kind; a path that is, or
holds, an input of the same command never. `--overwrite` is the user's say-so for the rest.
Directories written before markers existed are recognised by the files only fastdraft writes
there (LEGACY), so older runs still resume.

The commands check their outputs before any work (check_output_dir / check_output_file, naming
the setting that chose the path); utils/atomic.publish_dir checks again when it publishes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from fastdraft.errors import FastdraftError

MARKER = ".fastdraft"
#: What a directory holds, by the files fastdraft wrote there before it wrote MARKER.
LEGACY: dict[str, Callable[[Path], bool]] = {
    "run": lambda d: (d / "memory_plan.json").is_file()
    or ((d / "config.yaml").is_file() and (d / "metrics.jsonl").is_file()),
    "drafter": lambda d: (d / "drafter_config.json").is_file(),
    "export": lambda d: any((layout / "config.json").is_file() and (layout / "SHA256SUMS").is_file()
                            for layout in (d, d / "sglang", d / "vllm", d / "speculators")),
    "checkpoint": lambda d: (d / "COMPLETE").is_file(),
    "bootstrap": lambda d: (d / "report.json").is_file(),
    "warmup": lambda d: (d / "capture-0").is_dir(),
}
#: How a user's input is named in a refusal: (the setting that names it, its path).
Inputs = Iterable[tuple[str, Path | None]]
OVERWRITE_HINT = "or pass --overwrite to replace it"


def mark(directory: str | Path, kind: str) -> None:
    """Records in `directory` that fastdraft wrote it, holding `kind`."""
    (Path(directory) / MARKER).write_text(json.dumps({"kind": kind}) + "\n")


def kind_of(directory: Path) -> str | None:
    """What fastdraft wrote at `directory` (its marker's kind, or a legacy layout's); None: a
    directory fastdraft did not write (or not a directory)."""
    if not directory.is_dir():
        return None
    try:
        return str(json.loads((directory / MARKER).read_text())["kind"])
    except FileNotFoundError:
        return next((kind for kind, found in LEGACY.items() if found(directory)), None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def replaceable(path: Path, kind: str) -> bool:
    """Whether fastdraft may replace `path` with an output of `kind` unasked."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_dir() and not path.is_symlink():
        return not any(path.iterdir()) or kind_of(path) == kind
    return False


def check_output_dir(path: Path, kind: str, setting: str, inputs: Inputs = (),
                     overwrite: bool = False, hint: str = OVERWRITE_HINT) -> None:
    """`path` may take a directory of `kind`: absent, empty or fastdraft's own `kind`, and
    neither an input of the command nor holding one; else one line naming `setting` (and
    `hint`, what else the user may do)."""
    _check_not_input(path, setting, inputs, overwrite)
    if overwrite or replaceable(path, kind):
        return
    raise FastdraftError(f"{setting} {path}: {_what_is_there(path, kind)}; fastdraft replaces "
                         f"only what it wrote: choose a new or empty directory, {hint}")


def check_output_file(path: Path, kind: str, setting: str, inputs: Inputs = (),
                      overwrite: bool = False) -> None:
    """`path` may take a file of `kind` (json | png): absent, a file fastdraft wrote (its stamp
    says so), or a file in a directory fastdraft wrote (a run directory's dashboard)."""
    _check_not_input(path, setting, inputs, overwrite)
    if overwrite or not (path.exists() or path.is_symlink()):
        return
    if path.is_dir():
        raise FastdraftError(f"{setting} {path} is a directory: name a file")
    if kind_of(path.parent) is None and not _file_written_by_fastdraft(path, kind):
        raise FastdraftError(f"{setting} {path} is a file fastdraft did not write: choose "
                             f"another path, {OVERWRITE_HINT}")


def remove_output(path: Path, kind: str, setting: str, overwrite: bool = False,
                  hint: str = OVERWRITE_HINT) -> None:
    """Removes `path` for a fresh output of `kind`, if fastdraft may replace it."""
    check_output_dir(path, kind, setting, overwrite=overwrite, hint=hint)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def json_stamp(what: str) -> dict[str, str]:
    """The key that marks a JSON file as fastdraft's (check_output_file reads it)."""
    from fastdraft import __version__
    return {"fastdraft": f"{__version__} {what}"}


def png_stamp(what: str) -> dict[str, str]:
    """matplotlib savefig metadata that marks a PNG as fastdraft's."""
    from fastdraft import __version__
    return {"Software": f"fastdraft {__version__} {what}"}


def _file_written_by_fastdraft(path: Path, kind: str) -> bool:
    try:
        if kind == "json":
            return isinstance(json.loads(path.read_text()).get("fastdraft"), str)
        if kind == "png":
            from PIL import Image
            with Image.open(path) as image:
                return str(image.info.get("Software", "")).startswith("fastdraft")
    except (OSError, ValueError, AttributeError):
        return False
    raise AssertionError(f"unknown output file kind {kind!r}")


def _check_not_input(path: Path, setting: str, inputs: Inputs, overwrite: bool) -> None:
    """Writing at `path` must not replace an input of the same command (itself or a directory
    holding it)."""
    if overwrite:
        return
    target = path.expanduser().resolve()
    for name, given in inputs:
        if given is None:
            continue
        source = Path(given).expanduser().resolve()
        if source == target or target in source.parents:
            how = "is" if source == target else "holds"
            raise FastdraftError(f"{setting} {path} {how} {name} {given}, an input of this "
                                 f"command: writing there would replace it; choose another "
                                 f"{setting}")


def _what_is_there(path: Path, kind: str) -> str:
    if path.is_symlink() or not path.is_dir():
        return "a file is there"
    found = kind_of(path)
    if found is not None:
        return f"it holds a fastdraft {found}, not a {kind}"
    entries = sorted(p.name for p in path.iterdir())
    example = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    return f"it holds {count} fastdraft did not write ({example})"
