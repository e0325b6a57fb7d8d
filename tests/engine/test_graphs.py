import pytest
import torch

from fastdraft.engine.graphs import GraphPool


def test_without_cuda_every_stage_runs_eagerly():
    pool = GraphPool("cpu")
    calls = []
    for _ in range(3):
        pool.run(("decode", 1, 16), lambda: calls.append(1))
    assert len(calls) == 3 and not pool.enabled and pool.stats.num_graphs == 0
    assert ("decode", 1, 16) not in pool


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_graphs_on_a_cpu_device_are_refused():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphPool("cpu", enabled=True)
