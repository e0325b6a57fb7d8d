"""Mapping-valued settings and a task's options are checked when the recipe loads (before any
bootstrap or model build), each with one line naming the setting and what it accepts."""

from __future__ import annotations

import re

import pytest

from fastdraft.config import load_recipe


@pytest.mark.parametrize("overrides, message", [
    (["data.task_options.max_termz=5"], "has no option 'max_termz' (did you mean 'max_terms'?)"),
    (["data.task_options=abc"], "data.task_options must be a mapping"),
    (["data.task=nope"], "unknown task 'nope'"),
    (["data.task=null", "data.path=x.jsonl", "data.task_pool=8"],
     "data.task_options and data.task_pool belong to data.task"),
    (["rollout.tuner.buckets=abc"], "rollout.tuner.buckets must map a batch size"),
])
def test_dict_settings_and_task_options_are_checked_at_load(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe(None, overrides)
