"""The plain steps of RolloutEngine (a mixin its class inherits, as spec_step.py is): the
prefill that admits requests (a GRPO group's prompt computed once, a resumed request's answer
recomputed) and the plain decode step. It reads the engine's runner, proposer, io, graph pool
and buckets; engine/engine.py owns them and the rest of the step."""

from __future__ import annotations

import torch

from fastdraft.engine.capture import commit_starts
from fastdraft.engine.draws import sample_next
from fastdraft.engine.migration import Handoff
from fastdraft.engine.prefix_share import SharedPrefill
from fastdraft.engine.request import Request
from fastdraft.engine.rng import Stream, uniform_keyed
from fastdraft.engine.sampler import sample
from fastdraft.engine.scheduler import ScheduledBatch, Scheduler
from fastdraft.engine.step_io import SamplingMode
from fastdraft.models import HiddenStates


class PlainSteps:
    """Methods of RolloutEngine (self is the engine)."""

    def _prefill(self, scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
        """Prefills admitted requests and samples their first tokens. A resumed (migrated)
        request prefills all its tokens but the last and samples nothing: its last token is
        the root of its next step (engine/migration.py)."""
        requests = batch.requests
        share = SharedPrefill.of([r.prefill_token_ids for r in requests], self.share_prompts)
        if batch.chunk is None:
            logits, hidden = self.runner.prefill_shared(share, batch.slot_start, self.aux_layers)
            self.last_trace.prefill_computed += share.computed_tokens
        else:
            staged = self._prefill_chunk(share, batch)
            if staged is None:
                return []
            logits, hidden = staged
        self.last_trace.prefill_tokens += share.rows_tokens
        start, resumed = batch.slot_start, [bool(r.output_token_ids) for r in requests]
        self.io.sampling.admit(start, [r.params for r in requests], [r.seed for r in requests])
        st = self.io.sampling.tensors.rows(start, start + len(requests))
        mode = SamplingMode.of(requests)
        uniforms = None
        if mode is not SamplingMode.GREEDY:  # counter: the first token's position (prompt length)
            lens = torch.tensor([[r.prefill_len] for r in requests], device=st.keys.device)
            uniforms = uniform_keyed(st.key(Stream.SAMPLE), lens).squeeze(1)
        tokens, logprobs = sample(logits, st, uniforms, mode.needs_filter)
        tokens = Handoff.first_tokens(requests, tokens)
        if self.spec.enabled:
            self.proposer.on_prefill(Handoff.prefill_views(requests), hidden, start, tokens,
                                     share=share)
        rows = [[] if old else [(int(t), lp)] for (t, lp), old in zip(
            torch.stack([tokens.double(), logprobs.double()], 1).tolist(), resumed)]
        finished = self._postprocess(scheduler, batch, [[t for t, _ in r] for r in rows],
                                     [[lp for _, lp in r] for r in rows])
        if self.spec.enabled:   # as a fresh request hands its first token, a resumed one all
            for r in (r for r, old in zip(requests, resumed) if old):
                self.proposer.on_tokens(r, r.output_token_ids)
        if self.hidden_sink is not None:  # every prefilled position, paired with the next token
            # (a preempted request's were handed over before its preemption: none again)
            self._capture(requests, [r.num_tokens - 1 if r.preemptions else 0
                                     for r in requests], hidden)
        return finished

    def _prefill_chunk(self, share: SharedPrefill, batch: ScheduledBatch
                       ) -> tuple[torch.Tensor, HiddenStates] | None:
        """A chunk of a staged prompt (one prompt, for all of batch's requests) into the
        runner's staging slot. At the last chunk the cache lands in the requests' slots and
        what a one-shot prefill_shared returns comes back: the last token's logits and every
        token's hidden states, per request; before it, None."""
        prompt, (lo, hi) = share.prompts[0], batch.chunk
        staged = self.runner.prefill_staged(prompt, lo, hi, self.aux_layers)
        self.last_trace.prefill_computed += hi - lo
        if staged is None:
            return None
        logits, hidden = staged
        self.runner.land_staged(len(batch.requests), batch.slot_start, len(prompt))
        rows = torch.zeros(len(batch.requests), dtype=torch.long, device=logits.device)
        return logits[rows], HiddenStates(hidden.final[rows], tuple(a[rows] for a in hidden.aux))

    def _decode(self, scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
        """A plain decode step. With a drafter on device (speculation switched off for this
        step) the drafter is fed the sampled tokens and the policy's hidden states, so the
        next speculative step drafts from a cache in step: no re-prefill, no lost acceptance."""
        requests = batch.requests
        size = self.buckets.batch_bucket(len(requests))
        lengths = [r.num_tokens for r in requests]
        ctx_len = self.buckets.context_bucket(max(lengths))
        # Every row ends at the last cell and none is padding: no mask needed (exact buckets).
        sees_all = size == len(requests) and min(lengths) == ctx_len
        mode = SamplingMode.of(requests)
        capture = self.hidden_sink is not None
        feed = self.spec.enabled and self.proposer.drafts_on_device
        keep = capture or feed
        self.io.load([r.last_token_id for r in requests], [n - 1 for n in lengths], size)
        self.reserve_cells(lengths)
        self.graphs.run(("decode", size, ctx_len, mode, sees_all, keep),
                        lambda: self._decode_stage(size, ctx_len, mode, sees_all, keep))
        if feed:  # the drafter's cell of the new token sits one past the policy's context
            commit_ctx = self.buckets.context_bucket(max(lengths) + 1)
            self.graphs.run(("commit", size, commit_ctx, 1),
                            lambda: self.proposer.commit(self.io, size, commit_ctx, width=1))
        rows = self.io.read_out(len(requests))
        num_before = [len(r.output_token_ids) for r in requests]
        finished = self._postprocess(scheduler, batch, [[int(r[0])] for r in rows],
                                     [[r[1]] for r in rows])
        if capture:
            self._capture(requests, commit_starts(requests, num_before))
        return finished

    def _decode_stage(self, size: int, ctx_len: int, mode: SamplingMode,
                      sees_all: bool = False, keep_hidden: bool = False) -> None:
        io = self.io
        positions = io.root_pos[:size]
        logits, hidden = self.runner.decode(io.root_ids[:size], positions, ctx_len, sees_all,
                                            self.aux_layers if keep_hidden else ())
        tokens, logprobs = sample_next(logits, positions, io.sampling.rows(size), mode)
        if keep_hidden:  # for the capture and the drafter's commit
            io.keep_decoded(tokens, hidden)
        io.out[:size, 0] = tokens
        io.out[:size, 1] = logprobs
