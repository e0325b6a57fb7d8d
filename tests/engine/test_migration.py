"""Tail consolidation (engine/migration.py): a request that leaves one engine mid-generation and
finishes on another ends exactly as it would have on the first (tokens, logprobs, spec stats),
greedy and sampled, with and without an EAGLE drafter; and no request is ever lost."""

from __future__ import annotations

import itertools
import pickle
import random
import threading
import time

import pytest
import torch

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import build_drafter, save_drafter
from fastdraft.engine.capture import HiddenRecord
from fastdraft.engine.migration import Inbox, MigratedRequest
from fastdraft.engine.request import Completion
from fastdraft.engine.scheduler import Scheduler
from fastdraft.engine.spec.proposer import Proposer
from fastdraft.models import load_model
from tests.conftest import make_tiny_checkpoint

SPECS = {"none": SpecConfig(method="none"),
         "eagle": SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=6)}
MODES = ("greedy", "sampled")
# tiny: the shared fixture, whose next-token distributions are nearly flat (greedy falls into
# loops of 1-4 tokens; a random drafter's q is flat too, so the Gumbel noise, not the drafter's
# state, picks most drafts). sharp: 4x larger initial weights, policy logprobs about -2 per
# token (an LLM's range): greedy answers vary, and a drafter whose state were rebuilt wrong
# changes its q, hence the residual draws of rejected drafts, hence the sampled answers.
MODELS = ("tiny", "sharp")
N = 16
YIELD_BELOW = 6


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 64) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def _params(mode: str, n: int, seed: int = 11) -> list[SamplingParams]:
    """Answer caps spread 10..100 tokens, so the requests finish one after another and the last
    few (the tail) migrate with long answers already generated and more to go."""
    kind = dict(greedy=True) if mode == "greedy" else dict(temperature=1.0, seed=seed)
    return [SamplingParams(max_new_tokens=10 + 6 * i, **kind) for i in range(n)]


class _Engines:
    """Per model and spec method: one donor (A, also the reference: a plain generate of the same
    prompts) and one receiver (B: a separate engine object over the same weights), built once.
    The model is chosen with `use`."""

    def __init__(self, models: dict) -> None:
        self.models, self.model, self.built = models, "tiny", {}
        self.references: dict = {}

    def use(self, model: str) -> _Engines:
        self.model = model
        return self

    def __call__(self, method: str, role: str, max_batch_size: int = 32) -> RolloutEngine:
        key = (self.model, method, role, max_batch_size)
        if key not in self.built:
            path, drafter = self.models[self.model]
            self.built[key] = RolloutEngine(
                path, "cpu", max_batch_size=max_batch_size, max_seq_len=160,
                drafter=drafter if method == "eagle" else None, spec=SPECS[method])
        return self.built[key]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, random_drafter, tmp_path_factory) -> _Engines:
    sharp = tmp_path_factory.mktemp("sharp")
    make_tiny_checkpoint(sharp, initializer_range=0.08)
    policy = load_model(sharp)
    torch.manual_seed(0)
    save_drafter(build_drafter("eagle1", policy.config, 256).attach(policy), sharp / "drafter")
    return _Engines({"tiny": (tiny_checkpoint[0], random_drafter),
                     "sharp": (sharp, sharp / "drafter")})


def _reference(engines: _Engines, method: str, mode: str) -> list[Completion]:
    """The un-migrated generate of the 16 prompts (cached per configuration)."""
    key = (engines.model, method, mode)
    if key not in engines.references:
        engines.references[key] = engines(method, "A").generate(_prompts(N, 0),
                                                                _params(mode, N))
    return engines.references[key]


def _assert_same(got: list[Completion], ref: list[Completion], spec: bool) -> None:
    """got (any order, by .index) equals ref: tokens exactly, logprobs to 1e-4, and the spec
    statistics exactly (the same trees were drafted and verified on both paths)."""
    by_index = {c.index: c for c in got}
    assert sorted(by_index) == [c.index for c in ref] and len(by_index) == len(got)
    for r in ref:
        c = by_index[r.index]
        assert c.prompt_token_ids == r.prompt_token_ids
        assert c.token_ids == r.token_ids, f"request {r.index}"
        assert c.finish_reason == r.finish_reason
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64),
                                   torch.tensor(r.logprobs, dtype=torch.float64),
                                   atol=1e-4, rtol=0)
        if spec:
            assert c.spec == r.spec, f"request {r.index}"


def _yield_tail(engines: _Engines, method: str, mode: str, **kwargs
                ) -> tuple[list[Completion], list[MigratedRequest]]:
    donor = engines(method, "A")
    done = donor.generate(_prompts(N, 0), _params(mode, N), yield_below=YIELD_BELOW, **kwargs)
    migrated = donor.last_migrated
    assert 0 < len(migrated) < YIELD_BELOW and len(done) + len(migrated) == N
    assert [m.index for m in migrated] == sorted(m.index for m in migrated)
    assert all(m.output_token_ids for m in migrated)   # mid-answer, not merely queued
    assert {c.index for c in done}.isdisjoint(m.index for m in migrated)
    return done, migrated


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("model", MODELS)
def test_yielded_tail_finishes_exactly_on_an_idle_engine(engines, model, method, mode):
    engines.use(model)
    ref = _reference(engines, method, mode)
    done, migrated = _yield_tail(engines, method, mode)
    sent = pickle.loads(pickle.dumps(migrated))   # what crosses Ray actors
    receiver = engines(method, "B")
    rest = receiver.generate([], resume=sent)
    assert [c.index for c in rest] == [m.index for m in migrated]
    assert receiver.last_migrated == []
    _assert_same(done + rest, ref, spec=method != "none")
    # The records were not consumed: the same tail can be sent again (to another receiver).
    assert [m.output_token_ids for m in sent] == [m.output_token_ids for m in migrated]
    _assert_same(done + receiver.generate([], resume=sent), ref, spec=method != "none")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("model", MODELS)
def test_tail_joins_a_running_generate_through_its_inbox(engines, model, method, mode):
    engines.use(model)
    """Put before the call: drained at the first step boundary (joins the first prefill) while
    the receiver's own prompts, whose indices 0..7 collide with the tail's, run beside it."""
    ref = _reference(engines, method, mode)
    done, migrated = _yield_tail(engines, method, mode)
    receiver = engines(method, "B")
    own_prompts, own_params = _prompts(8, seed=5), _params(mode, 8, seed=99)
    own_ref = receiver.generate(own_prompts, own_params)
    inbox = Inbox()
    assert inbox.put(migrated)
    outs = receiver.generate(own_prompts, own_params, inbox=inbox)
    assert receiver.last_trace.active[0] == 8 + len(migrated)   # all there for the first step
    own, rest = outs[:8], outs[8:]
    _assert_same(own, own_ref, spec=method != "none")
    assert [c.index for c in rest] == [m.index for m in migrated]
    _assert_same(done + rest, ref, spec=method != "none")
    assert inbox.closed and not inbox.put(migrated)   # the caller must send them elsewhere


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("model", MODELS)
def test_tail_put_mid_generation_joins_running_requests(engines, model, method, mode):
    engines.use(model)
    """Put from the receiver's first on_finish (its own requests mid-answer): resumed prefills
    run into slots beside running requests, which must not notice."""
    ref = _reference(engines, method, mode)
    done, migrated = _yield_tail(engines, method, mode)
    receiver = engines(method, "B")
    own_prompts, own_params = _prompts(8, seed=5), _params(mode, 8, seed=99)
    own_ref = receiver.generate(own_prompts, own_params)
    inbox, accepted = Inbox(), []

    def on_finish(c: Completion) -> None:
        if not accepted:
            accepted.append(inbox.put(migrated))

    outs = receiver.generate(own_prompts, own_params, inbox=inbox, on_finish=on_finish)
    assert accepted == [True] and receiver.last_trace.active[0] == 8
    _assert_same(outs[:8], own_ref, spec=method != "none")
    _assert_same(done + outs[8:], ref, spec=method != "none")


def test_queued_requests_migrate_too(engines):
    """A donor with 4 slots yields after its first step: 4 requests mid-answer (one token)
    and 12 never admitted (no tokens): the receiver prefills and samples those as fresh ones,
    from the streams the donor would have used."""
    engines.use("sharp")
    ref = _reference(engines, "none", "sampled")
    donor = engines("none", "A", max_batch_size=4)
    done = donor.generate(_prompts(N, 0), _params("sampled", N), yield_below=N + 1)
    migrated = donor.last_migrated
    assert done == [] and len(migrated) == N
    assert sorted(len(m.output_token_ids) for m in migrated) == [0] * 12 + [1] * 4
    _assert_same(engines("none", "B").generate([], resume=migrated), ref, spec=False)


def test_no_yield_without_yield_below_or_consent(engines):
    engines.use("sharp")
    ref = _reference(engines, "none", "greedy")
    donor = engines("none", "A")
    _assert_same(donor.generate(_prompts(N, 0), _params("greedy", N)), ref, spec=False)
    assert donor.last_migrated == []
    asked = []

    def never() -> bool:
        asked.append(len(asked))
        return False

    outs = donor.generate(_prompts(N, 0), _params("greedy", N), yield_below=YIELD_BELOW,
                          should_yield=never)
    assert asked and donor.last_migrated == []   # asked in the tail, refused every time
    _assert_same(outs, ref, spec=False)
    assert [c.index for c in outs] == list(range(N))


def test_inbox_never_strands_a_request(engines):
    """A put after the generate's last drain but before it yields lands in last_migrated (the
    close and the put share a lock); a put after the end is refused; a closed inbox cannot be
    reused."""
    engines.use("sharp")
    ref = _reference(engines, "none", "greedy")
    _, migrated = _yield_tail(engines, "none", "greedy")
    late = migrated[:1]
    inbox = Inbox()

    def put_then_yield() -> bool:   # asked after the step's drain: the put is never drained
        assert inbox.put(late)
        return True

    donor = engines("none", "A")
    done = donor.generate(_prompts(N, 0), _params("greedy", N), yield_below=YIELD_BELOW,
                          inbox=inbox, should_yield=put_then_yield)
    left = donor.last_migrated   # its own tail (as before) and the late arrival
    assert sorted(m.index for m in left) == sorted([late[0].index] + [m.index for m in migrated])
    assert inbox.closed and not inbox.put(late)
    with pytest.raises(ValueError, match="closed"):
        donor.generate(_prompts(1, 0), inbox=inbox)
    # Every one of them still finishes exactly (the late one twice: it was sent twice).
    rest = engines("none", "B").generate([], resume=left)
    assert [c.index for c in rest] == [m.index for m in left]
    once = {c.index: c for c in reversed(rest)}
    _assert_same(done + list(once.values()), ref, spec=False)
    twice = [c for c in rest if c.index == late[0].index]
    assert len(twice) == 2 and twice[0].token_ids == twice[1].token_ids


def test_inbox_fed_from_another_thread(engines):
    """A sender thread puts the tail one request at a time while the receiver generates: each
    put either lands (the request finishes exactly, in this call's results) or is refused once
    the call has ended (the sender keeps it); none is lost, none runs twice."""
    engines.use("sharp")
    ref = _reference(engines, "none", "sampled")
    done, migrated = _yield_tail(engines, "none", "sampled")
    inbox, accepted, refused = Inbox(), [], []
    started = threading.Event()

    def send() -> None:
        started.wait()
        for m in migrated:
            (accepted if inbox.put([m]) else refused).append(m)
            time.sleep(0.005)

    sender = threading.Thread(target=send)
    sender.start()
    receiver = engines("none", "B")
    own_prompts, own_params = _prompts(8, seed=5), _params("sampled", 8, seed=99)
    outs = receiver.generate(own_prompts, own_params, inbox=inbox,
                             on_finish=lambda c: started.set())
    sender.join()
    assert len(accepted) + len(refused) == len(migrated) and receiver.last_migrated == []
    assert [c.index for c in outs[8:]] == [m.index for m in accepted]
    rest = engines("none", "B").generate([], resume=refused)   # the sender's fallback
    _assert_same(done + outs[8:] + rest, ref, spec=False)


class _RacingInbox(Inbox):
    """Puts `late` the moment the generate finds its inbox empty with no work left: the put
    that races the end of the call."""

    def __init__(self, late: list[MigratedRequest]) -> None:
        super().__init__()
        self.late, self.accepted = late, None

    def take(self, close_if_empty: bool = False) -> list[MigratedRequest]:
        items = super().take(close_if_empty)
        if close_if_empty and not items and self.accepted is None:
            self.accepted = self.put(self.late)
        return items


def test_a_put_racing_the_end_is_refused(engines):
    """A generate that runs to its end closes its inbox in the same critical section as its
    last (empty) drain: the racing put is refused (the caller keeps the requests), so a call
    that did not yield never hands anything back."""
    engines.use("tiny")
    _, migrated = _yield_tail(engines, "none", "greedy")
    inbox = _RacingInbox(migrated)
    receiver = engines("none", "B")
    outs = receiver.generate(_prompts(3, 1), SamplingParams(greedy=True, max_new_tokens=5),
                             inbox=inbox)
    assert inbox.accepted is False and receiver.last_migrated == [] and len(outs) == 3


@pytest.mark.parametrize("method", list(SPECS))
def test_receiver_hidden_records_cover_a_migrated_request(engines, method):
    engines.use("sharp")
    """The receiver's records of a migrated request cover every position of its sequence, each
    once, paired with the right tokens, with the hidden states an un-migrated run captures; the
    donor's records of it are a prefix (the caller drops them)."""
    prompts, params = _prompts(N, 0), _params("sampled", N)
    ref_records: list[HiddenRecord] = []
    ref = engines(method, "A").generate(prompts, params, on_hidden=ref_records.append)
    donor_records: list[HiddenRecord] = []
    done, migrated = _yield_tail(engines, method, "sampled", on_hidden=donor_records.append)
    recv_records: list[HiddenRecord] = []
    rest = engines(method, "B").generate([], resume=migrated, on_hidden=recv_records.append)
    _assert_same(done + rest, ref, spec=method != "none")
    for m in migrated:
        seq = m.prompt_token_ids + ref[m.index].token_ids
        mine = [r for r in recv_records if r.request_index == m.index]
        positions = torch.cat([r.positions for r in mine])
        assert positions.tolist() == list(range(len(seq) - 1))
        assert torch.cat([r.token_ids for r in mine]).tolist() == seq[1:]
        want = torch.cat([r.final for r in ref_records if r.request_index == m.index])
        torch.testing.assert_close(torch.cat([r.final for r in mine]).float(), want.float(),
                                   atol=2e-2, rtol=2e-2)
        theirs = torch.cat([r.positions for r in donor_records if r.request_index == m.index])
        held = len(m.prompt_token_ids) + len(m.output_token_ids)
        assert theirs.tolist() == list(range(held - 1))


def test_migrated_request_checks():
    params = SamplingParams(greedy=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="logprobs"):
        MigratedRequest(0, [5], [6, 7], [0.0], params, 0)
    with pytest.raises(ValueError, match="finished"):
        MigratedRequest(0, [5], [6] * 4, [0.0] * 4, params, 0)
    ok = MigratedRequest(0, [5], [6], [0.0], params, 0)
    with pytest.raises(ValueError, match="stop token"):
        MigratedRequest(0, [5], [1], [0.0], params, 0).to_request(64, 160, frozenset({1}))
    with pytest.raises(ValueError, match="cap"):
        ok.to_request(64, 2, frozenset())
    request = ok.to_request(64, 160, frozenset())
    assert (request.prefill_token_ids, request.last_token_id) == ([5], 6)
    request.output_token_ids.append(9)
    assert ok.output_token_ids == [6]


class _Recorder(Proposer):
    """Drafts nothing; records what the engine tells a proposer about each request."""

    def __init__(self) -> None:
        self.prefills: dict[int, tuple[list[int], int]] = {}
        self.tokens: dict[int, list[list[int]]] = {}

    def on_prefill(self, requests, hidden, slot_start, first_tokens, share=None) -> None:
        for r, t in zip(requests, first_tokens.tolist()):
            assert hidden.final.shape[1] >= len(r.prompt_token_ids)
            self.prefills[r.index] = (list(r.prompt_token_ids), int(t))

    def on_tokens(self, request, new_token_ids) -> None:
        self.tokens.setdefault(request.index, []).append(list(new_token_ids))


def test_proposer_sees_a_resumed_request_as_a_fresh_one(engines, tiny_checkpoint):
    """on_prefill: the prefilled tokens as the prompt and the known last token as the first one
    (what EAGLE builds its cache from); on_tokens: everything the request holds at once, as a
    model-free drafter (suffix) must be fed, then each step's new tokens, never an empty list."""
    engines.use("tiny")
    _, migrated = _yield_tail(engines, "none", "sampled")
    receiver = RolloutEngine(tiny_checkpoint[0], max_batch_size=8, max_seq_len=160,
                             spec=SpecConfig(method="suffix", depth=3, topk=2,
                                             tokens_to_verify=6))
    receiver.proposer = recorder = _Recorder()
    outs = receiver.generate([], resume=migrated)
    for m, c in zip(migrated, outs, strict=True):
        held = m.prompt_token_ids + m.output_token_ids
        assert recorder.prefills[m.index] == (held[:-1], held[-1])
        calls = recorder.tokens[m.index]
        assert calls[0] == m.output_token_ids and all(calls)
        fed = list(itertools.chain.from_iterable(calls))
        assert fed == c.token_ids[: len(fed)]   # the finishing step is not fed


def test_scheduler_budgets_a_resumed_prefill_by_what_it_prefills():
    """A resumed request re-prefills its answer too: chunks are budgeted (and sorted) by that
    length, not the prompt's, so max_prefill_tokens still bounds a chunk's padded tokens."""
    params = SamplingParams(greedy=True, max_new_tokens=100)
    held = [MigratedRequest(i, [5] * 5, [7] * 56, [0.0] * 56, params, 0) for i in range(2)]
    scheduler = Scheduler(num_slots=4, max_prefill_tokens=100)
    fresh = MigratedRequest(2, [5] * 30, [], [], params, 0)
    for m in [*held, fresh]:
        scheduler.add(m.to_request(64, 160, frozenset()))
    chunks = [[r.index for r in scheduler.schedule().requests] for _ in range(3)]
    assert chunks == [[2], [0], [1]]   # 30, then 60 and 60: two of those exceed 100
    assert [r.prefill_len for r in scheduler.running] == [30, 60, 60]
