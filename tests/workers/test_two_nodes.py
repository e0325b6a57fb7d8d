"""Hybrid workers across two Ray nodes (ray.cluster_utils.Cluster: two raylets on this machine,
one CPU each, both at the loopback address): one worker a node, the actor's process group
rendezvous at the address Ray gives worker 0's node, and the run takes its RL steps."""

from __future__ import annotations

import pytest

from fastdraft.observability.metrics import read_metrics
from fastdraft.run.loop import train
from fastdraft.run.run import Run
from tests.run.test_loop import _cfg


@pytest.fixture
def two_nodes(monkeypatch):
    ray = pytest.importorskip("ray")
    import ray._private.services as services
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    # ray.init turns a loopback address into this machine's outside one: keep it loopback
    with monkeypatch.context() as patch:
        patch.setattr(services, "get_node_ip_address", lambda address=None: "127.0.0.1")
        ray.init(address=cluster.address, log_to_driver=False)
    yield ray
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.xdist_group("ray")
def test_hybrid_workers_on_two_nodes_rendezvous_where_ray_says_and_train(
        two_nodes, char_policy, tmp_path):
    ray = two_nodes
    run = Run(_cfg(char_policy, "cluster.backend=ray", "cluster.placement=hybrid",
                   "cluster.rollout_workers=2", "actor.num_ranks=2", "algorithm.num_steps=3",
                   "logging.dashboard=false"), tmp_path / "run")
    try:
        nodes = ray.get([w.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()) for w in run.engine.workers])
        assert len(set(nodes)) == 2   # one worker on each node
        assert run.engine.actor.address == "127.0.0.1" and run.engine.actor.port > 0
        train(run)
    finally:
        run.close_after_failure()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["cluster/rollout0/generate_s"] > 0 and r["cluster/rollout1/generate_s"] > 0
               and r["rollout/logprob_diff_max"] < 1e-3 for r in rows)
    assert rows[-1]["policy/version"] == 3.0
