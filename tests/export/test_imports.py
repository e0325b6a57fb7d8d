"""Drafters from engine directories: fastdraft's own exports (SpecForge/SGLang and speculators
layouts, with and without a draft vocabulary) come back drafting the very same tokens; a
checkpoint written by hand in SpecForge's documented key layout imports with its own lm_head and
aux layers, serves losslessly and trains; every mismatch with the policy is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from fastdraft import RolloutEngine, SamplingParams
from fastdraft.config.engine import SpecConfig
from fastdraft.drafter import Drafter, load_drafter
from fastdraft.drafter.losses import drafter_loss
from fastdraft.engine.spec.draft_head import DraftHead
from fastdraft.errors import FastdraftError
from fastdraft.export import export_drafter
from fastdraft.export.imports import engine_layout, import_drafter
from fastdraft.models import CausalLM
from tests.export.conftest import (
    MAX_POSITIONS,
    load_policy,
    saved_drafter,
    specforge_checkpoint,
)

H, VOCAB, LAYERS, DRAFT_VOCAB = 64, 64, 4, 40


def _prompts(n: int = 32) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (int(torch.randint(3, 11, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]


@torch.no_grad()
def drafted_chains(policy: CausalLM, drafter: Drafter, prompts: list[list[int]],
                   depth: int = 4) -> list[list[int]]:
    """The greedy chain of `depth` tokens the drafter proposes after each prompt (the policy's
    own next token first), as target token ids."""
    head, chains = DraftHead(drafter), []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        positions = torch.arange(len(prompt)).view(1, -1)
        logits, hidden = policy(ids, positions, aux_layers=drafter.aux_layers)
        feats = drafter.target_features(hidden)
        inputs = torch.cat([ids[:, 1:], logits[:, -1:].argmax(-1)], 1)
        chain = []
        for _ in range(depth):
            out = drafter.advance(feats, inputs, positions + 1)
            token = head.to_target(head.logits(out[:, -1:]).argmax(-1))
            chain.append(int(token))
            feats, inputs = torch.cat([feats, out[:, -1:]], 1), torch.cat([inputs, token], 1)
            positions = torch.cat([positions, positions[:, -1:] + 1], 1)
        chains.append(chain)
    return chains


@pytest.mark.parametrize("draft_ids", [None, [5, 2, 40, 7, 63, 0, 9, 11]],
                         ids=["full-vocab", "draft-vocab"])
def test_exports_import_back_drafting_the_same_tokens(llama_policy_dir, tmp_path, draft_ids):
    policy = load_policy(llama_policy_dir)
    original = saved_drafter(policy, "eagle3", tmp_path / "drafter", seed=4,
                             draft_token_ids=draft_ids)
    want = drafted_chains(policy, original, _prompts())
    written = export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out", "both")
    assert [engine_layout(p) for p in written] == ["sglang", "speculators"]
    for path in written:
        out = import_drafter(path, llama_policy_dir, tmp_path / f"imported-{path.name}")
        imported = load_drafter(out, policy, MAX_POSITIONS)
        assert imported.head is None   # the policy's own rows: borrowed again, not copied
        assert drafted_chains(policy, imported, _prompts()) == want
        assert json.loads((out / "drafter_config.json").read_text())["imported_layout"] == (
            path.name)


def _specforge_dir(path: Path, *, config: dict | None = None, drop: tuple[str, ...] = ()
                   ) -> Path:
    return specforge_checkpoint(path, vocab=VOCAB, draft_vocab=DRAFT_VOCAB,
                                sglang_aux_ids=[0, 1, 2], config=config, drop=drop)


def test_a_specforge_checkpoint_imports_serves_and_trains(llama_policy_dir, tmp_path):
    policy = load_policy(llama_policy_dir)
    src = _specforge_dir(tmp_path / "specforge")
    assert engine_layout(src) == "sglang"
    out = import_drafter(src, llama_policy_dir, tmp_path / "imported")
    drafter = load_drafter(out, policy, MAX_POSITIONS)
    # SGLang's ids [0, 1, 2] name layer outputs: the inputs of layers 1, 2, 3.
    assert drafter.aux_layers == (1, 2, 3)
    assert drafter.head is not None and drafter.head.out_features == DRAFT_VOCAB
    assert len(drafter.draft_token_ids) == DRAFT_VOCAB
    chains = drafted_chains(policy, drafter, _prompts())
    assert {t for chain in chains for t in chain} <= set(drafter.draft_token_ids.tolist())

    # It serves: greedy speculative output is plain greedy, token for token.
    prompts, params = _prompts(6), SamplingParams(greedy=True, max_new_tokens=10)
    plain = RolloutEngine(llama_policy_dir, max_batch_size=6, max_seq_len=32).generate(
        prompts, params)
    engine = RolloutEngine(llama_policy_dir, max_batch_size=6, max_seq_len=32, drafter=out,
                           spec=SpecConfig(method="eagle", depth=3, topk=2, tokens_to_verify=4))
    assert [c.token_ids for c in engine.generate(prompts, params)] == [
        c.token_ids for c in plain]

    # It trains: its own lm_head and layers get gradients from the policy's distribution.
    drafter.train()
    ids = torch.tensor(prompts[:1])
    _, hidden = policy(ids, torch.arange(ids.shape[1]).view(1, -1),
                       aux_layers=drafter.aux_layers)
    loss, _ = drafter_loss(drafter, ids, hidden, torch.ones_like(ids, dtype=torch.bool),
                           policy.lm_head)
    loss.backward()
    assert drafter.head.weight.grad.abs().sum() > 0 and drafter.fc.weight.grad.abs().sum() > 0

    # And leaves again: each layout names the aux layers as its engine counts them.
    sglang, speculators = export_drafter(out, llama_policy_dir, tmp_path / "export", "all")
    assert json.loads((sglang / "config.json").read_text())["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    assert json.loads((speculators / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    for path in (sglang, speculators):
        again = load_drafter(import_drafter(path, llama_policy_dir, tmp_path / f"re-{path.name}"),
                             policy, MAX_POSITIONS)
        assert again.aux_layers == (1, 2, 3) and drafted_chains(policy, again,
                                                                _prompts()) == chains


def test_aux_layer_ids_count_hidden_states_as_hf_does(llama_policy_dir):
    """fastdraft's (and vLLM's, speculators') aux layer k is HF's hidden_states[k] (the
    embedding at 0): the input of layer k; SGLang/SpecForge's id k is hidden_states[k + 1]."""
    policy = load_policy(llama_policy_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_policy_dir).eval()
    ids = torch.tensor([_prompts()[0]])
    with torch.no_grad():
        _, hidden = policy(ids, torch.arange(ids.shape[1]).view(1, -1), aux_layers=(0, 1, 3))
        states = hf(ids, output_hidden_states=True).hidden_states
    for got, k in zip(hidden.aux, (0, 1, 3), strict=True):
        torch.testing.assert_close(got.float(), states[k].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("edit, line", [
    (dict(config={"hidden_size": 32}), "hidden_size: drafter 32, policy 64"),
    (dict(config={"vocab_size": 128}), "vocab_size: drafter 128, policy 64"),
    (dict(drop=("d2t", "t2d")), "draft_vocab_size 40 < the policy's vocabulary 64, but there "
                                "is no d2t"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}),
     "aux layers [1, 2, 6] (as layer inputs): the policy has layers 0..3"),
    (dict(config={"max_position_embeddings": 128}),
     "max_position_embeddings: drafter 128, policy 256"),
    (dict(config={"hidden_size": "64"}), "hidden_size is '64' in its config.json, not a number"),
], ids=["hidden", "vocab", "no-d2t", "aux-range", "positions", "string"])
def test_each_mismatch_with_the_policy_is_one_line(llama_policy_dir, tmp_path, edit, line):
    src = _specforge_dir(tmp_path / "specforge", **edit)
    with pytest.raises(FastdraftError) as err:
        import_drafter(src, llama_policy_dir, tmp_path / "imported")
    lines = str(err.value).splitlines()   # one line: the CLI prints it as the error
    assert len(lines) == 1 and lines[0].split("does not fit the policy: ")[1].startswith(line), \
        lines
    assert not (tmp_path / "imported").exists()


def test_an_integer_weight_or_a_config_that_is_not_json_is_one_line(llama_policy_dir,
                                                                    tmp_path):
    """An int32 fc.weight was cast silently (accept length 1.11 instead of ~5.9)."""
    from safetensors.torch import load_file, save_file
    src = _specforge_dir(tmp_path / "specforge")
    tensors = load_file(src / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"].to(torch.int32)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(FastdraftError, match=r"fc\.weight is torch\.int32, not a float type"):
        import_drafter(src, llama_policy_dir, tmp_path / "imported")
    (src / "config.json").write_text("{not json")
    with pytest.raises(FastdraftError, match=r"config\.json is not JSON \(Expecting"):
        import_drafter(src, llama_policy_dir, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_speculators_norm_before_residual_is_refused(llama_policy_dir, tmp_path):
    """vLLM's default for a speculators EAGLE-3 is the normed features as the residual, which
    is another drafter than fastdraft's: said, never imported silently."""
    policy = load_policy(llama_policy_dir)
    saved_drafter(policy, "eagle3", tmp_path / "drafter")
    [spec] = export_drafter(tmp_path / "drafter", llama_policy_dir, tmp_path / "out",
                            "speculators")
    config = json.loads((spec / "config.json").read_text())
    del config["norm_before_residual"]
    (spec / "config.json").write_text(json.dumps(config))
    (spec / "SHA256SUMS").unlink()
    with pytest.raises(FastdraftError, match="norm_before_residual is not false"):
        import_drafter(spec, llama_policy_dir, tmp_path / "imported")


def test_the_import_command_writes_a_drafter_the_run_loads(llama_policy_dir, tmp_path, capsys):
    from fastdraft.cli import main
    src = _specforge_dir(tmp_path / "specforge")
    assert main(["drafter", "import", "--source", str(src), "--policy", str(llama_policy_dir),
                 "--out", str(tmp_path / "imported")]) == 0
    assert "imported from the sglang layout" in capsys.readouterr().out
    drafter = load_drafter(tmp_path / "imported", load_policy(llama_policy_dir), MAX_POSITIONS)
    assert drafter.aux_layers == (1, 2, 3) and drafter.head is not None
    assert main(["drafter", "import", "--source", str(tmp_path), "--policy",
                 str(llama_policy_dir), "--out", str(tmp_path / "none")]) == 2
    assert "no config.json of an engine drafter" in capsys.readouterr().err


def test_import_never_replaces_a_users_directory_or_file_or_its_source(llama_policy_dir,
                                                                       tmp_path, capsys):
    """`drafter import --out DIR` of a directory of the user's emptied it (rc 0); an --out file
    became a drafter directory. Now: exit 2, one line, the files intact; an earlier drafter is
    replaced; --overwrite is the user's say-so."""
    from fastdraft.cli import main
    from tests.test_outputs import snapshot
    src = _specforge_dir(tmp_path / "specforge")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n')
    base = ["drafter", "import", "--source", str(src), "--policy", str(llama_policy_dir)]
    for out, line in ((mine, f"--out {mine}: it holds 1 entry fastdraft did not write"),
                      (prompts, f"--out {prompts}: a file is there"),
                      (src, f"--out {src} is --source {src}, an input of this command"),
                      (llama_policy_dir, f"--out {llama_policy_dir} is --policy")):
        before = {p: snapshot(p) for p in (mine, prompts, src, llama_policy_dir)}
        assert main([*base, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and line in err[0], err
        assert {p: snapshot(p) for p in before} == before
    out = tmp_path / "imported"
    assert main([*base, "--out", str(out)]) == 0
    assert main([*base, "--out", str(out)]) == 0   # its own earlier drafter: replaced
    assert main([*base, "--out", str(mine), "--overwrite"]) == 0
    assert not (mine / "notes.txt").exists() and (mine / "drafter_config.json").is_file()
    capsys.readouterr()
