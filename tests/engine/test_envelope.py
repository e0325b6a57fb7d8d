import pytest

from fastdraft.config.engine import SpecConfig
from fastdraft.engine.envelope import Envelope


def test_every_size_derives_from_the_largest_tree():
    env = Envelope.for_spec(100, SpecConfig(method="suffix", depth=6, topk=4, tokens_to_verify=16))
    assert env.num_draft_scratch == 20          # 5 expanded levels of 4 nodes
    assert env.tree_cells == 20                 # the larger of 16 verify nodes and 20 scratch
    assert env.cache_len == 120 and env.commit_width == 7 and env.rope_len == 107
    deep = Envelope(max_seq_len=50, max_depth=9, max_topk=1, max_tree_nodes=4)
    assert deep.tree_cells == 10                # a commit of 9 path tokens + the bonus


def test_plain_decoding_needs_no_tree_cells():
    env = Envelope.for_spec(64, SpecConfig())
    assert env.tree_cells == 0 and env.cache_len == 64
    with pytest.raises(ValueError, match="max_seq_len"):
        Envelope(max_seq_len=1)
