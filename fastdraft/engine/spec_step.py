"""The speculative step of RolloutEngine (a mixin its class inherits): propose -> verify (one
policy forward over every tree) -> accept -> postprocess, and length-aware budgets' split steps,
whose plain rows decode in the same forward. It reads the engine's runner, proposer, io, graph
pool, buckets and budget; engine/engine.py owns them and the rest of the step."""

from __future__ import annotations

from fastdraft.config.engine import SpecConfig
from fastdraft.engine.capture import commit_starts
from fastdraft.engine.draws import accept_tree, sample_next
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.request import Request
from fastdraft.engine.scheduler import Phase, ScheduledBatch, Scheduler
from fastdraft.engine.step_io import SamplingMode


class SpeculativeStep:
    """Methods of RolloutEngine (self is the engine)."""

    def _put_long_first(self, scheduler: Scheduler, batch: ScheduledBatch
                        ) -> tuple[ScheduledBatch, int]:
        """Length-aware budgets (spec/budget.py): the rows predicted to set the makespan move
        to slots 0..L-1 and speculate, the others decode plainly in the same forward. L is
        rounded up to a batch bucket (padding rows would cost the same)."""
        assert self.budget is not None
        first = self.budget.choose(batch.requests, self.buckets.batch_bucket)
        if 0 < len(first) < len(batch.requests):
            self._move(scheduler.put_first(first))
            batch = ScheduledBatch(Phase.DECODE, list(scheduler.running))
        return batch, len(first)

    def _speculate(self, scheduler: Scheduler, batch: ScheduledBatch, cfg: SpecConfig,
                   num_spec: int) -> list[Request]:
        """propose -> verify (one policy forward over every tree) -> accept -> postprocess.
        Rows num_spec.. (length-aware budgets) decode plainly in the same forward."""
        requests, io, proposer = batch.requests, self.io, self.proposer
        tree_requests = requests[:num_spec]
        root_pos = [r.num_tokens - 1 for r in requests]
        size, plain_size, ctx_len, plain_ctx, plain_commit_ctx = self._split_shape(
            root_pos, num_spec, cfg)
        mode = SamplingMode.of(requests)
        width = proposer.draft_width(cfg)
        io.load([r.last_token_id for r in requests], root_pos, size + plain_size)
        self.reserve_cells([r.num_tokens + (width if i < num_spec else 0)   # the tree's cells
                            for i, r in enumerate(requests)])
        assert io.drafts is not None
        if proposer.drafts_on_device:
            sampled_drafts = mode is not SamplingMode.GREEDY
            self.graphs.run(("draft", size, ctx_len, cfg.depth, cfg.topk, width, mode),
                            lambda: proposer.draft(io, size, ctx_len, cfg, mode))
            proposer.after_draft(io, tree_requests, cfg, size)
        else:
            drafts = proposer.propose(tree_requests, cfg)
            sampled_drafts = drafts.parent_probs is not None
            io.drafts.store(drafts, size, width)
        capture = self.hidden_sink is not None
        stage = (size, ctx_len, width, cfg.depth, mode, sampled_drafts, capture, plain_size,
                 plain_ctx)
        self.graphs.run(("verify", *stage), lambda: self._verify_stage(*stage))
        if proposer.drafts_on_device:   # plain rows commit their one token
            self.graphs.run(("commit", size, ctx_len, cfg.depth + 1),
                            lambda: proposer.commit(io, size, ctx_len, width=cfg.depth + 1))
            if plain_size:
                self.graphs.run(("commit", plain_size, plain_commit_ctx, 1, size),
                                lambda: proposer.commit(io, plain_size, plain_commit_ctx,
                                                        width=1, start=size))
        rows = io.read_out(len(requests))
        num_before = [len(r.output_token_ids) for r in requests]
        w = io.commit_width
        counts = [int(row[0]) + 1 for row in rows]
        finished = self._postprocess(
            scheduler, batch, [[int(t) for t in row[3: 3 + n]] for row, n in zip(rows, counts)],
            [row[3 + w: 3 + w + n] for row, n in zip(rows, counts)])
        for r, row, before in zip(tree_requests, rows, num_before):
            r.spec.record_row(row, w, len(r.output_token_ids) - before)
        if self.budget is not None:
            self.budget.observe(sum(counts[:num_spec]) / num_spec)
        if capture:
            self._capture(requests, commit_starts(requests, num_before))
        return finished

    def _split_shape(self, root_pos: list[int], num_spec: int, cfg: SpecConfig
                     ) -> tuple[int, int, int, int, int]:
        """Padded sizes of a step whose first num_spec rows verify trees: (tree rows, plain
        rows, tree context, plain context, plain rows' drafter-commit context). With plain
        rows, num_spec is a bucket already (_put_long_first); theirs pads with free slots."""
        num_plain = len(root_pos) - num_spec
        tree_ctx = self.buckets.context_bucket(max(root_pos[:num_spec]) + 1
                                               + Envelope.cells_of(cfg))
        if not num_plain:
            return self.buckets.batch_bucket(num_spec), 0, tree_ctx, 0, 0
        last = max(root_pos[num_spec:])
        # The drafter's cell of a plain row's new token sits one past the policy's context.
        return (num_spec, min(self.buckets.batch_bucket(num_plain),
                              self.max_batch_size - num_spec),
                tree_ctx, self.buckets.context_bucket(last + 1),
                self.buckets.context_bucket(last + 2))

    def _verify_stage(self, size: int, ctx_len: int, width: int, depth: int,
                      mode: SamplingMode, sampled_drafts: bool, capture: bool = False,
                      plain_size: int = 0, plain_ctx: int = 0) -> None:
        """Rows 0..size-1 verify their trees; rows size..size+plain_size-1 (if any) take a
        plain decode step in the same forward."""
        io = self.io
        assert io.drafts is not None
        drafts = io.drafts.view(size, width, sampled_drafts)
        root_ids, root_pos = io.root_ids[:size + plain_size], io.root_pos[:size + plain_size]
        keep_hidden = self.proposer.drafts_on_device or capture
        if plain_size:
            (logits, hidden), (plain_logits, plain_hidden) = self.runner.verify_split(
                root_ids, root_pos, drafts, ctx_len, plain_ctx, self.aux_layers)
            st = io.sampling.tensors.rows(size, size + plain_size)
            tokens, logprobs = sample_next(plain_logits, root_pos[size:], st, mode)
            if keep_hidden:
                io.keep_decoded(tokens, plain_hidden, start=size)
            io.write_plain_out(tokens, logprobs, start=size)
        else:
            logits, hidden = self.runner.verify(root_ids, root_pos, drafts, ctx_len,
                                                self.aux_layers)
        acc = accept_tree(drafts, logits, root_pos[:size], io.sampling.rows(size), depth, mode,
                          stop_early=self.eager_shortcuts)
        self.runner.compact(root_pos[:size], acc)
        io.keep_accepted(acc, hidden, depth, with_hidden=keep_hidden)
        io.write_spec_out(acc, drafts, depth)
