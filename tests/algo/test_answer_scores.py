"""The actor's packed, chunked forward (algo/answer_scores.py) against the padded one it replaces
(the whole micro-batch's logits, then log-softmax: algo/logprobs.py): the same logprobs, the
same loss and gradients, the same statistics for the gate, on a batch mixing 30-token and
3000-token answers; and the logits of a 16k-token answer with a 152k vocabulary never exist at
once."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastdraft.algo.answer_scores import AnswerScores, ChunkedLogprob, ScoreSpec
from fastdraft.algo.logprobs import logprobs_of, next_token_logits
from fastdraft.algo.objective import Algorithm
from fastdraft.algo.sequences import build_batch, micro_batches
from fastdraft.algo.token_stats import token_stats
from fastdraft.config.sections import AlgorithmConfig
from fastdraft.models import CausalLM, ModelConfig

CFG = ModelConfig.from_hf_dict(dict(
    model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    tie_word_embeddings=False))


def _long_tailed_batch():
    g = torch.Generator().manual_seed(1)
    lengths = [30, 3000, 30, 45, 30]
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (12, 7, 9, 12, 5)]
    answers = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    olds = [(-2.0 + 0.1 * torch.randn(n, generator=g)).tolist() for n in lengths]
    return build_batch(prompts, answers, olds, [1.0, -1.0, 0.5, 0.2, -0.3])


def _loss_and_grads(model, batch, logprobs_fn):
    """The GRPO batch loss (token-mean) of one micro-batch holding the whole batch."""
    model.zero_grad()
    logprobs = logprobs_fn()
    loss, _ = Algorithm(AlgorithmConfig(), 0.7).objective(batch, None)(logprobs, batch)
    loss.backward()
    return logprobs.detach(), loss.detach(), {n: p.grad.clone()
                                              for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed,chunk", [(True, 0), (True, 100), (False, 100)])
def test_packed_chunked_scores_give_the_padded_loss_and_gradients(packed, chunk):
    torch.manual_seed(0)
    model = CausalLM(CFG, 4096)
    batch = _long_tailed_batch()
    padded = _loss_and_grads(model, batch, lambda: logprobs_of(
        next_token_logits(model, batch.input_ids), batch.input_ids, 0.7) * batch.mask)
    spec = ScoreSpec(temperature=0.7, chunk_tokens=chunk, packed=packed)
    mine = _loss_and_grads(model, batch, lambda: AnswerScores(batch, spec).forward(model)[0])
    assert float((mine[0] - padded[0]).abs().max()) <= 2e-6          # logprobs
    assert float((mine[1] - padded[1]).abs()) <= 1e-6 * float(padded[1].abs())   # loss
    for name, grad in padded[2].items():
        scale = float(grad.abs().max())
        assert float((mine[2][name] - grad).abs().max()) <= 1e-6 * max(scale, 1.0), name


def test_the_gates_statistics_are_the_padded_ones():
    torch.manual_seed(0)
    model = CausalLM(CFG, 4096)
    batch = _long_tailed_batch()
    with torch.no_grad():
        padded = token_stats(next_token_logits(model, batch.input_ids), batch.input_ids[:, 1:],
                             0.7, top_p=0.9, top_k=20, mask=batch.mask)
        spec = ScoreSpec(temperature=0.7, chunk_tokens=100, top_p=0.9, top_k=20)
        _, mine, _ = AnswerScores(batch, spec).forward(model, stats=True)
    for a, b in zip(padded, mine, strict=True):
        assert torch.equal(a.isfinite(), b.isfinite())   # -inf: outside the nucleus
        finite = a.isfinite()
        assert float((a[finite] - b[finite]).abs().max()) <= 2e-6


def test_packed_micro_batches_count_real_tokens():
    batch = _long_tailed_batch()
    lengths = (batch.mask.long().cumsum(1).argmax(1) + 2).tolist()
    assert max(lengths) < sum(lengths) <= 3300 < 2 * max(lengths)
    padded, packed = micro_batches(batch, 3300), micro_batches(batch, 3300, packed=True)
    assert len(padded) == 2 and len(packed) == 1   # padded: 5 rows x 3000+; packed: real


class _LargestTensor(TorchDispatchMode):
    """The most elements any tensor made inside the mode has (shapes only: on meta tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_a_16k_answers_logits_never_exist_at_once():
    """16,384 answer tokens, a 152k vocabulary, chunks of 1024: no tensor of the forward and
    backward is larger than one chunk's logits, where the padded loss makes [16k, V] ones."""
    tokens, vocab, hidden, chunk = 16384, 152064, 512, 1024
    with torch.device("meta"):
        h = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.zeros(tokens, dtype=torch.long)
    mode = _LargestTensor()
    with mode:
        ChunkedLogprob.apply(h, weight, targets, 1.0, chunk, None).sum().backward()
    assert h.grad.shape == h.shape and weight.grad.shape == weight.shape
    # one chunk's logits, or the head's gradient (V x H, as F.linear's backward makes it)
    assert mode.largest == max(chunk * vocab, vocab * hidden) < tokens * vocab
    full = _LargestTensor()
    with full:
        logits = (h @ weight.t()).float()
        (logits.gather(-1, targets[:, None]) - logits.logsumexp(-1, keepdim=True)).sum().backward()
    assert full.largest == tokens * vocab
