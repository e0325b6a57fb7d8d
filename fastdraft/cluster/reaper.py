"""The local Ray cluster dies with the run. `ray.init()` fate-shares its GCS and raylet with the
driver, but a SIGKILLed driver leaves Ray's per-node agents (DashboardAgent, RuntimeEnvAgent)
running for good, reparented to init. This watcher, started just before a local cluster, notes
the run's descendant processes every SCAN_S seconds; when the run's process is gone it
SIGKILLs what it last saw, and any `ray::` process orphaned since it started (one the raylet
spawned after the last look). Ray rewrites its processes' titles and environments, so they are
found by ancestry and start time.

`python -m fastdraft.cluster.reaper RUN_PID` prints the watcher's pid and returns (started by
cluster/ray_cluster.connect, which kills the watcher when it shuts Ray down itself)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

SCAN_S = 0.5
ROUNDS = 20   # of SCAN_S after the run died


def _stat(pid: int | str) -> tuple[str, int, int]:
    """(comm, parent pid, start time in clock ticks) of a process, from /proc/PID/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    comm = text[text.index("(") + 1:text.rindex(")")]   # may hold spaces and parentheses
    fields = text[text.rindex(")") + 2:].split()
    return comm, int(fields[1]), int(fields[19])


def _processes() -> dict[int, tuple[str, int, int]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):   # gone meanwhile
                out[int(entry.name)] = _stat(entry.name)
    return out


def descendants(root: int, table: dict[int, tuple[str, int, int]] | None = None) -> set[int]:
    """Every living process below `root`, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in (table or _processes()).items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


#: A Ray worker's command line while it still boots (before it renames itself `ray::...`).
RAY_WORKER = b"ray/_private/workers/default_worker.py"


def orphaned_ray(since: int) -> set[int]:
    """Ray processes reparented to init that started at or after `since` (clock ticks): named
    `ray::...`, or workers still booting (a CI run saw two outlive a SIGKILLed run by 20 s)."""
    return {pid for pid, (comm, ppid, start) in _processes().items()
            if ppid == 1 and start >= since and (comm.startswith("ray::") or _booting(pid))}


def _booting(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return RAY_WORKER in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False


def main() -> None:
    """Prints the watcher's pid and returns at once; the watcher runs detached: not a child
    of the run, since Ray's raylet kills a dead driver's children (this one too) before it
    goes."""
    run = int(sys.argv[1])
    born = _stat(run)[2]   # the run's start time: its pid alone could be reused
    child = os.fork()
    if child:
        print(child, flush=True)
        os._exit(0)
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)   # the launcher's reader sees EOF
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the run's to handle
    watch(run, born)


def watch(run: int, born: int) -> None:
    me = os.getpid()
    since = _stat(me)[2]
    seen: set[int] = set()
    while _is(run, born):
        seen = descendants(run) - {me}
        time.sleep(SCAN_S)
    # Again for a few seconds: a process the raylet was starting as the run died shows up
    # orphaned only after it, and a killed agent can linger (unmapping the object store).
    for _ in range(ROUNDS):
        targets = {pid for pid in seen | orphaned_ray(since) if _alive(pid)}
        if not targets:
            break
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        seen = targets
        time.sleep(SCAN_S)


def _is(pid: int, born: int) -> bool:
    """The process `pid` that started at `born` still runs."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return _stat(pid)[2] == born and _alive(pid)
    return False


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (new) parent to reap it."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


if __name__ == "__main__":
    main()
