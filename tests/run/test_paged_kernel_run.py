"""rollout.paged_attention: triton in an RL run: every decode and verify step of the rollouts
reads the paged cache through the Triton kernel (on the CPU: Triton's interpreter, in a fresh
process, since it must be on before triton is imported) and the lossless gate holds. The GPU
run that would make the kernel the default is scripts/gpu-check.sh's "long" part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdraft.config import load_recipe

_ROOT = Path(__file__).parents[2]
_RUN = """
import json, sys
from pathlib import Path
from fastdraft.run.loop import train_step
from fastdraft.run.run import Run
from tests.run.test_loop import _cfg
run = Run(_cfg(sys.argv[1], "rollout.paged_attention=triton", "rollout.kv_block_size=8",
               "rollout.spec.method=suffix", "algorithm.num_steps=2", "rollout.prompts_per_step=1",
               "checkpoint.every=2"), Path(sys.argv[2]))
kernel, calls = run.engine.runner.paged_attention, [0]
def counted(*args):
    calls[0] += 1
    return kernel(*args)
run.engine.runner.paged_attention = counted
rows = [train_step(run, step) for step in range(2)]
run.finish()
print(json.dumps({"calls": calls[0], "diff": [r["rollout/logprob_diff_max"] for r in rows],
                  "kernel": kernel.__name__}))
"""


def test_an_rl_run_rolls_out_through_the_triton_kernel_and_holds_the_gate(char_policy,
                                                                          tmp_path):
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _RUN, str(char_policy), str(tmp_path / "run")],
                         cwd=_ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["kernel"] == "paged_attention_triton" and out["calls"] > 0
    assert all(d < 1e-3 for d in out["diff"]), out


def test_the_kernel_setting_is_checked_when_the_recipe_loads():
    with pytest.raises(ValueError, match="gather or triton"):
        load_recipe(None, ["rollout.paged_attention=flash"])
    with pytest.raises(ValueError, match=r"set rollout\.kv_block_size > 0"):
        load_recipe(None, ["rollout.paged_attention=triton", "rollout.kv_block_size=0"])
    assert load_recipe(None, []).rollout.paged_attention == "gather"
