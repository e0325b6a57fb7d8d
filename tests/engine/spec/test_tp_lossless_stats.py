"""The engine's sampled-law test (test_engine_lossless_stats.py: EAGLE trees, T = 1, a vocabulary
of 8) with the policy split over two tensor-parallel gloo ranks (models/tensor_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.models.local_ranks import run_ranks
from fastdraft.models.tensor_parallel import TPRank
from tests.engine.spec.stat_utils import chi_square_pvalue, counts_of
from tests.engine.spec.test_engine_lossless_stats import (
    LENGTH,
    NUM_SAMPLES,
    PROMPT,
    SEED,
    _expected,
)

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(temperature=1.0, seed=SEED, max_new_tokens=LENGTH, ignore_eos=True)


def _sample_law(tp: TPRank, path: Path) -> dict:
    engine = RolloutEngine(path, max_batch_size=512, max_seq_len=16, tp=tp,
                           spec=SpecConfig(method="eagle", depth=3, topk=3, tokens_to_verify=6),
                           drafter=path / "drafter")
    outs = engine.generate([PROMPT] * NUM_SAMPLES, PARAMS)
    return {"counts": counts_of([o.token_ids for o in outs], LENGTH),
            "accepted": engine.last_stats.num_accepted}


def test_tp2_speculative_samples_follow_the_policys_law(tiny_vocab, tmp_path):
    path, hf = tiny_vocab
    ranks = run_ranks(2, _sample_law, path, workdir=tmp_path)
    assert ranks[0]["counts"] == ranks[1]["counts"]
    assert ranks[0]["accepted"] > 2000
    assert chi_square_pvalue(ranks[0]["counts"], _expected(hf, PARAMS)) > 0.01
