"""Micro-benchmark of the suffix drafter (not a test): `python -m fastdraft.bench.suffix_bench`.
Times insertion, start/extend and propose over synthetic GRPO-like rollouts of one prompt."""

from __future__ import annotations

import time

from fastdraft.engine.spec.suffix import SuffixConfig, SuffixDrafter
from fastdraft.engine.spec.tree import ROOT, DraftTree


def _noisy_copy(base: list[int], rng, vocab: int, edit_rate: float) -> list[int]:
    """A rollout that mostly repeats `base` with random substitutions / insertions / deletions,
    like GRPO samples of one prompt."""
    out: list[int] = []
    for tok in base:
        r = rng.random()
        if r < edit_rate / 3:
            out.append(rng.randrange(vocab))
        elif r < 2 * edit_rate / 3:
            out.extend((tok, rng.randrange(vocab)))
        elif r >= edit_rate:
            out.append(tok)
    return out


def bench_suffix(num_steps: int = 4, rollouts_per_step: int = 4, rollout_len: int = 500,
                 prompt_len: int = 200, vocab: int = 32000, edit_rate: float = 0.1,
                 seed: int = 0) -> dict[str, float]:
    """Time the drafter on a synthetic GRPO prompt: num_steps * rollouts_per_step rollouts of
    ~rollout_len tokens in the window, then one held-out rollout decoded with drafts (greedy
    acceptance against the held-out tokens; each round commits the accepted path + 1 token)."""
    import random
    import tracemalloc

    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(rollout_len)]
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    cfg = SuffixConfig()
    drafter = SuffixDrafter(cfg)
    rollouts = [_noisy_copy(base, rng, vocab, edit_rate)
                for _ in range(num_steps * rollouts_per_step)]
    t0 = time.perf_counter()
    for i, rollout in enumerate(rollouts):
        drafter.add_rollout("p", rollout, step=i // rollouts_per_step)
    add_s = time.perf_counter() - t0
    num_stored = drafter.stored_tokens("p")
    tracemalloc.start()  # memory measured on a second copy: tracing slows allocation a lot
    copy = SuffixDrafter(cfg)
    for i, rollout in enumerate(rollouts):
        copy.add_rollout("p", rollout, step=i // rollouts_per_step)
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del copy

    target = _noisy_copy(base, rng, vocab, edit_rate)
    t0 = time.perf_counter()
    drafter.start("r", "p", prompt)
    start_s = time.perf_counter() - t0
    drafter.propose("r")  # warm-up: the first torch call in a process is slow
    propose_s: list[float] = []
    extend_s = 0.0
    num_nodes = accepted_total = pos = 0
    while pos < len(target):
        t0 = time.perf_counter()
        tree = drafter.propose("r")
        propose_s.append(time.perf_counter() - t0)
        num_nodes += tree.num_nodes
        accepted = _greedy_accept(tree, target[pos:])
        new = target[pos: pos + accepted + 1]
        accepted_total += len(new) - 1
        pos += len(new)
        t0 = time.perf_counter()
        drafter.extend("r", new)
        extend_s += time.perf_counter() - t0
    drafter.finish("r")

    loop = [7, 8, 9] * 3000  # a degenerate looping answer: the count walk must stay bounded
    t0 = time.perf_counter()
    drafter.add_rollout("loop", loop, step=num_steps - 1)
    loop_s = time.perf_counter() - t0

    propose_s.sort()
    rounds = len(propose_s)
    stats = {
        "stored_tokens": num_stored,
        "add_rollout_us_per_token": 1e6 * add_s / sum(map(len, rollouts)),
        "index_bytes_per_token": index_bytes / num_stored,
        "start_us": 1e6 * start_s,
        "extend_us_per_token": 1e6 * extend_s / len(target),
        "propose_us_mean": 1e6 * sum(propose_s) / rounds,
        "propose_us_p50": 1e6 * propose_s[rounds // 2],
        "propose_us_p99": 1e6 * propose_s[min(rounds - 1, int(rounds * 0.99))],
        "mean_nodes": num_nodes / rounds,
        "tokens_per_round": len(target) / rounds,
        "accepted_per_round": accepted_total / rounds,
        "loop_add_us_per_token": 1e6 * loop_s / len(loop),
    }
    for name, value in stats.items():
        print(f"{name:>28s}  {value:10.2f}")
    return stats


def _greedy_accept(tree: DraftTree, future: list[int]) -> int:
    """Nodes accepted when the policy's next tokens are exactly `future`."""
    children = tree.children()
    tokens = tree.tokens.tolist()
    node, accepted = ROOT, 0
    while accepted < len(future):
        nxt = [c for c in children[node + 1] if tokens[c] == future[accepted]]
        if not nxt:
            break
        node, accepted = nxt[0], accepted + 1
    return accepted


if __name__ == "__main__":
    bench_suffix()
