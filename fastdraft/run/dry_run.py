"""`fastdraft run RECIPE --dry-run`: the checks a run makes before its first step
(run/preflight.py, the same function), and the memory plans of its engine, its actor and the
whole run printed for a node of actor.num_ranks devices: exit 0 if all pass, an error naming
what to change if not. Of the checkpoints it reads config.json, the tokenizer, the weight files'
headers and drafter_config.json: no weights, no engine, no bootstrap training (a bootstrap
policy is planned from its cached checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastdraft.actor.memory_plan import ActorPlan, RunPlan
from fastdraft.config import RunConfig
from fastdraft.drafter import build_drafter
from fastdraft.engine.envelope import Envelope
from fastdraft.engine.memory_plan import DrafterShape, plan_engine
from fastdraft.engine.paged_kv import kv_blocks_in
from fastdraft.errors import FastdraftError
from fastdraft.export.imports import engine_layout
from fastdraft.models import ModelConfig
from fastdraft.models.tensor_parallel import shard_config, tensor_parallel_sizes
from fastdraft.trainer.memory_plan import TrainerPlan
from fastdraft.trainer.online_drafter import trainer_aux_layers
from fastdraft.utils.atomic import atomic_write_text
from fastdraft.utils.device_memory import GB, Capacity, host_memory
from fastdraft.utils.outputs import json_stamp

#: A CUDA recipe planned where no GPU is visible: a node of 80 GB devices (A100 / H100).
DEFAULT_GPU_GB = 80.0


def plan_run(cfg: RunConfig, policy_dir: Path, drafter_dir: Path | None,
             max_seq_len: int, tensor_parallel: int | None = None) -> RunPlan:
    """The plan of the engine and actor a Run builds from cfg: policy_dir's config.json,
    drafter_dir's drafter_config.json (None: a drafter the run warms up, of drafter.kind).
    tensor_parallel: instead of rollout.tensor_parallel (each worker's engine: one rank)."""
    model_config = ModelConfig.from_pretrained(policy_dir)
    tp = tensor_parallel or cfg.rollout.tensor_parallel
    spec = cfg.rollout.spec
    tuner = (cfg.rollout.tuner.build(spec, cfg.seed, cfg.rollout.max_batch_size)
             if cfg.rollout.tuner.enabled else None)
    drafter = _drafter_shape(cfg, drafter_dir, model_config)
    engine = plan_engine(
        model_config, envelope=Envelope.for_spec(max_seq_len, spec, tuner.arms if tuner else ()),
        num_slots=cfg.rollout.max_batch_size, dtype=getattr(torch, cfg.model.dtype),
        device=cfg.model.device, spec=spec, drafter=drafter,
        capture_aux_layers=_trainer_capture(cfg, drafter_dir, drafter, model_config),
        graphs=cfg.rollout.graphs, kv_block_size=cfg.rollout.kv_block_size,
        prefill_chunk_tokens=cfg.rollout.prefill_chunk_tokens, tensor_parallel=tp,
        kv_blocks=kv_blocks_in(cfg.rollout.kv_cache_gb, shard_config(model_config, tp),
                               getattr(torch, cfg.model.dtype), cfg.rollout.kv_block_size))
    actor = ActorPlan.of(model_config, cfg.actor, cfg.algorithm.kl_coef, max_seq_len=max_seq_len)
    hybrid = cfg.cluster.placement == "hybrid"
    trainer = trainer_plan(cfg, model_config, engine.drafter_weights) if hybrid else None
    members = cfg.cluster.rollout_workers if cfg.cluster.drafter_training == "data_parallel" else 1
    on_cpu = engine.shape.device == "cpu"
    return RunPlan(engine=engine, actor=actor, hybrid=hybrid,
                   trainer=0 if trainer is None else trainer.total * (members if on_cpu else 1))


def smallest_tensor_parallel(cfg: RunConfig, policy_dir: Path, drafter_dir: Path | None,
                             max_seq_len: int, capacity_bytes: int) -> int | None:
    """The fewest hybrid workers an engine replica can span for the run to fit (k divides
    the workers and the policy's heads, KV heads and MLP features); None: none fits, or the
    placement is not hybrid (only hybrid workers form tensor-parallel replicas)."""
    if cfg.cluster.placement != "hybrid":
        return None
    workers = cfg.cluster.rollout_workers
    sizes = tensor_parallel_sizes(ModelConfig.from_pretrained(policy_dir), workers)
    return next((k for k in sizes if workers % k == 0
                 and _fits(cfg, policy_dir, drafter_dir, max_seq_len, k, capacity_bytes)), None)


def _fits(cfg: RunConfig, policy_dir: Path, drafter_dir: Path | None, max_seq_len: int,
          tensor_parallel: int, capacity_bytes: int) -> bool:
    try:   # a rank's share of rollout.kv_cache_gb may hold no longest sequence at this k
        plan = plan_run(cfg, policy_dir, drafter_dir, max_seq_len, tensor_parallel)
    except FastdraftError:
        return False
    return plan.fits(capacity_bytes)


def _trainer_capture(cfg: RunConfig, drafter_dir: Path | None, drafter: DrafterShape | None,
                     model_config: ModelConfig) -> tuple[int, ...]:
    """The aux layers the engine keeps for the online trainer (trainer_aux_layers, from the
    drafter's shape: an engine directory has no drafter_config.json)."""
    if drafter is None or drafter_dir is None:
        return ()
    if engine_layout(drafter_dir) is None:
        return trainer_aux_layers(cfg.drafter.online, drafter_dir)
    if not cfg.drafter.online.enabled:
        return ()
    with torch.device("meta"):
        return tuple(build_drafter(drafter.kind, model_config, 1, aux_layers=drafter.aux_layers,
                                   head_rows=drafter.head_rows).aux_layers)


def trainer_plan(cfg: RunConfig, model_config: ModelConfig, drafter_weights: int
                 ) -> TrainerPlan | None:
    """One online drafter trainer member's plan (None: no online drafter, or no drafter of
    its own weights to train)."""
    if not cfg.drafter.online.enabled or not drafter_weights:
        return None
    return TrainerPlan.of(model_config, cfg.drafter.online, drafter_weights,
                          getattr(torch, cfg.model.dtype).itemsize,
                          torch.device(cfg.model.device).type == "cpu")


def node_capacity(device: str, device_gb: float | None) -> Capacity:
    """One device of the node: device_gb decimal GB each; else this machine's GPU (its whole
    memory) for a CUDA recipe, DEFAULT_GPU_GB where none is visible, the RAM for a CPU one."""
    name = str(torch.device(device))
    if device_gb is not None:
        if device_gb <= 0:
            raise FastdraftError(f"--device-memory-gb must be > 0, got {device_gb}")
        return Capacity.of(name, int(device_gb * GB))
    if torch.device(device).type != "cuda":
        total, available = host_memory()
        return Capacity.of(name, total, available)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        return Capacity.of(name, props.total_memory)
    return Capacity.of(name, int(DEFAULT_GPU_GB * GB))


def dry_run(cfg: RunConfig, device_gb: float | None = None, json_path: Path | None = None,
            cache_dir: Path | None = None, run_dir: Path | None = None, resume: bool = False,
            resume_force: bool = False, overwrite: bool = False) -> int:
    """Every check the run makes before its first step, in its order, the plans printed (and
    written to json_path); raises a user error at the first that fails. run_dir (the run's):
    its owner and contents as the run's claim checks them (run/run_dir.py), the checkpoint a
    resume would start from (sizes checked, not hashed), then run/preflight.py; nothing is
    created or taken there."""
    from fastdraft.checkpoint import CheckpointManager
    from fastdraft.config.recipe import config_dict
    from fastdraft.errors import Place
    from fastdraft.run.preflight import preflight
    from fastdraft.run.resume_check import resume_point
    from fastdraft.run.run_dir import check_run_dir_free
    if run_dir is not None:
        check_run_dir_free(run_dir, overwrite=overwrite)
        with CheckpointManager(run_dir, keep=cfg.checkpoint.keep) as checkpoints:
            resume_point(checkpoints, config_dict(cfg), resume or resume_force, resume_force,
                         digests=False)
    capacity = node_capacity(cfg.model.device, device_gb)
    plan = preflight(cfg, capacity, cache_dir, None if run_dir is None
                     else Place(run_dir, "--run-dir"), dry=True).plan
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(
            {**json_stamp("dry run"), "recipe": cfg.name, "device_bytes": capacity.total,
             "usable_bytes": capacity.usable, **plan.as_dict()}, indent=2))
    print(f"dry run: {cfg.name} fits (inputs checked, no weights loaded)")
    return 0


def _engine_drafter_shape(path: Path, policy_config: ModelConfig) -> DrafterShape:
    """An engine directory's drafter as the plan sees it (its checks made): an lm_head it
    carries is counted as its own (a borrowed one's draft rows cost as much)."""
    from fastdraft.export.imports import read_engine_drafter
    src = read_engine_drafter(path, policy_config)
    ids, head = src.draft_token_ids, src.lm_head
    return DrafterShape(kind=src.kind, draft_vocab=None if ids is None else len(ids),
                        head_rows=None if head is None else head.shape[0],
                        aux_layers=src.aux_layers)


def _drafter_shape(cfg: RunConfig, drafter_dir: Path | None,
                   policy_config: ModelConfig) -> DrafterShape | None:
    """drafter.path's kind and draft vocabulary; a bootstrap policy's drafter is warmed up by
    the run with drafter.kind over every token."""
    if not cfg.rollout.spec.uses_drafter:
        return None
    if drafter_dir is None:
        return DrafterShape(kind=cfg.drafter.kind)
    if engine_layout(drafter_dir) is not None:   # planned from its files, nothing imported
        return _engine_drafter_shape(drafter_dir, policy_config)
    shape = DrafterShape.read(drafter_dir)
    if shape is None:
        raise FileNotFoundError(f"drafter.path {drafter_dir}: no drafter_config.json there; "
                                "point it at a directory written by `fastdraft drafter warmup`")
    return shape
