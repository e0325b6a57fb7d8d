"""The actor's ranks 1..N-1 as processes of their own (rank 0 is the run's process): each builds
its ActorRank and then does what rank 0 asks, in the order it asks, so the collectives inside
(FSDP's all-gathers and reduce-scatters, the state gathers) pair up across ranks.

Commands go over one pipe per rank: (method name, arguments); each rank answers ("ok", value)
or ("error", traceback). Rank 0 never waits unboundedly: a rank that died is reported with its
exit code. A rank dies with rank 0 and leaves stop signals to it (utils/process.py), so a killed
run leaves no orphans and a Ctrl-C lets the step under way finish.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from fastdraft.actor.rank import ActorRank, ActorSpec
from fastdraft.utils.process import become_helper

REPLY_TIMEOUT_S = 3 * 3600.0   # one command (a long update, a checkpoint gather) at most


class ActorRankError(RuntimeError):
    """A follower rank failed or died; the message carries its traceback or exit code."""


def _serve(spec: ActorSpec, rank: int, conn: Any, num_threads: int) -> None:
    become_helper()
    torch.set_num_threads(num_threads)
    try:
        actor = ActorRank(spec, rank)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            name, args = conn.recv()
        except EOFError:   # rank 0 is gone
            return
        if name == "close":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(actor, name)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ActorPeers:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, spec: ActorSpec, num_threads: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.processes = [], []
        for rank in range(1, spec.actor.num_ranks):
            mine, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(spec, rank, theirs, num_threads),
                                  name=f"fastdraft-actor-rank{rank}", daemon=True)
            process.start()
            self.conns.append(mine)
            self.processes.append(process)

    def send(self, name: str, per_rank_args: list[tuple] | tuple = ()) -> None:
        """Asks every follower to run `name`; per_rank_args: one tuple per follower, or one
        tuple for all."""
        for i, conn in enumerate(self.conns):
            args = per_rank_args[i] if per_rank_args and isinstance(per_rank_args, list) \
                else per_rank_args
            conn.send((name, args))

    def gather(self, what: str, timeout: float = REPLY_TIMEOUT_S) -> list[Any]:
        """Every follower's answer to the last command, in rank order."""
        return [self._reply(rank, conn, what, timeout)
                for rank, conn in enumerate(self.conns, start=1)]

    def started(self) -> None:
        self.gather("start-up")

    def lost(self, grace_s: float = 0.0) -> str | None:
        """The first follower that died, as words; None when all live. grace_s: how long to
        watch for a death still on its way: a killed rank's sockets close (and rank 0's
        collective fails) a moment before its exit can be reaped."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    return f"actor rank {rank} died (exit code {process.exitcode})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, timeout_s: float = 30.0) -> None:
        for conn, process in zip(self.conns, self.processes):
            if process.is_alive():
                try:
                    conn.send(("close", ()))
                    if conn.poll(timeout_s):
                        conn.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass
            process.join(timeout=timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
            conn.close()

    def _reply(self, rank: int, conn: Any, what: str, timeout: float) -> Any:
        process = self.processes[rank - 1]
        waited = 0.0
        while not conn.poll(1.0):
            waited += 1.0
            if not process.is_alive():
                raise ActorRankError(f"actor rank {rank} died during {what} (exit code "
                                     f"{process.exitcode})")
            if waited > timeout:
                raise ActorRankError(f"actor rank {rank} sent nothing for {what} in "
                                     f"{timeout:.0f} s")
        try:
            status, value = conn.recv()
        except EOFError:
            raise ActorRankError(f"actor rank {rank} died during {what} (exit code "
                                 f"{process.exitcode})") from None
        if status == "error":
            raise ActorRankError(f"actor rank {rank} failed during {what}:\n{value}")
        return value
