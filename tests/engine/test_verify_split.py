"""ModelRunner.verify_split (draft-tree rows beside plain decode rows in one packed forward,
models.GroupedAttn) against the slow reference: verify() of the tree rows and decode() of the
plain rows as two forwards over two copies of the same cache."""

from __future__ import annotations

import copy
import random

import torch

from fastdraft.config.engine import SpecConfig
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.model_runner import ModelRunner
from fastdraft.engine.spec.batch import DraftBatch
from fastdraft.engine.spec.tree import ROOT, DraftTree
from fastdraft.models import load_model


def _tree(rng: random.Random, num_nodes: int) -> DraftTree:
    parents = [ROOT] + [rng.randrange(-1, i) for i in range(1, num_nodes)]
    return DraftTree(torch.tensor([rng.randrange(3, 64) for _ in range(num_nodes)]),
                     torch.tensor(parents), None, None)


@torch.inference_mode()
def test_verify_split_equals_verify_and_decode_apart(tiny_checkpoint):
    path, _ = tiny_checkpoint
    torch.manual_seed(0)
    rng = random.Random(0)
    model = load_model(path)
    envelope = Envelope.for_spec(64, SpecConfig(method="eagle", depth=4, topk=2,
                                                tokens_to_verify=6))
    split = ModelRunner(model, envelope, num_slots=5)
    prompts = [[rng.randrange(3, 64) for _ in range(n)] for n in (7, 12, 3, 9, 15)]
    split.prefill(prompts, 0)
    apart = ModelRunner(copy.deepcopy(model), envelope, num_slots=5)
    apart.kv_cache.copy_(split.kv_cache)
    root_ids = torch.tensor([rng.randrange(3, 64) for _ in prompts])
    root_pos = torch.tensor([len(p) for p in prompts])
    drafts = DraftBatch.from_trees([_tree(rng, 6), _tree(rng, 4)])
    (logits, hidden), (plain_logits, plain_hidden) = split.verify_split(
        root_ids, root_pos, drafts, ctx_len=30, plain_ctx_len=20, aux_layers=(1,))
    ref_logits, ref_hidden = apart.verify(root_ids[:2], root_pos[:2], drafts, 30, (1,))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden.final, ref_hidden.final, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hidden.aux[0], ref_hidden.aux[0], rtol=1e-4, atol=1e-5)
    apart_plain = ModelRunner(copy.deepcopy(model), envelope, num_slots=3)
    apart_plain.kv_cache.copy_(split.kv_cache[:, :, 2:])
    ref_plain, ref_plain_hidden = apart_plain.decode(root_ids[2:], root_pos[2:], 20,
                                                     aux_layers=(1,))
    torch.testing.assert_close(plain_logits, ref_plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(plain_hidden.final, ref_plain_hidden.final, rtol=1e-4, atol=1e-5)
    # Both wrote the same K/V: the tree rows' cells and the plain rows' new cell.
    torch.testing.assert_close(split.kv_cache[:, :, :2], apart.kv_cache[:, :, :2])
    torch.testing.assert_close(split.kv_cache[:, :, 2:], apart_plain.kv_cache)
