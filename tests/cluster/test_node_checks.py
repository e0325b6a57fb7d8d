"""Before any worker starts, every worker's node is asked whether it sees the run's paths and can
run fastdraft: a node that cannot is one line naming it and what is missing."""

from __future__ import annotations

import pytest

from fastdraft.cluster import node_checks
from fastdraft.cluster.node_checks import check_nodes
from fastdraft.cluster.reserve import reserve
from fastdraft.errors import FastdraftError


@pytest.fixture
def group(local_ray):
    from ray.util.placement_group import remove_placement_group
    group = reserve([{"CPU": 1}], 60, "a test")
    yield group
    remove_placement_group(group)


@pytest.mark.xdist_group("ray")
def test_a_node_without_a_path_is_named(group, tmp_path):
    check_nodes(group, 1, {"model.path": tmp_path, "drafter.path": None}, 60)   # all there
    with pytest.raises(FastdraftError, match=r"^node \S+ has no model\.path \S+/missing "
                                             r"\(worker bundle 0\): every node needs the run's "
                                             r"paths at the same place"):
        check_nodes(group, 1, {"model.path": tmp_path / "missing"}, 60)


@pytest.mark.xdist_group("ray")
def test_a_node_that_cannot_import_fastdraft_is_named(group, monkeypatch):
    def no_package(paths):   # what a node without the install answers
        raise ModuleNotFoundError("No module named 'fastdraft'")

    monkeypatch.setattr(node_checks, "look", no_package)
    with pytest.raises(FastdraftError, match=r"worker bundle 0 cannot run fastdraft \(.*No "
                                             r"module named 'fastdraft'.*\): install the same "
                                             r"fastdraft"):
        check_nodes(group, 1, {}, 60)
