"""Process memory helpers: the resident size follows the pages the process touches, and
trimming freed heap is safe to call at any time."""

from __future__ import annotations

import mmap
import sys

import pytest

from fastdraft.utils.memory import release_free_memory, rss_mb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rss_follows_touched_pages_and_trim_is_safe():
    size = 64 * 2**20
    before = rss_mb()
    block = mmap.mmap(-1, size)          # fresh anonymous pages: resident once written
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    during = rss_mb()
    assert before is not None and during is not None and during - before > 48
    block.close()
    assert isinstance(release_free_memory(), bool)
    assert rss_mb() < during - 48
