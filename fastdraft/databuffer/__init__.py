"""Hidden-state DataBuffer: finished rollouts in, packed drafter training batches out."""

from fastdraft.databuffer.buffer import BufferStats, DataBuffer
from fastdraft.databuffer.offset_sampler import longest_tail, select_offset
from fastdraft.databuffer.packing import PackedBatch, block_causal_mask, pack, pack_rows, pad
from fastdraft.databuffer.sample import Sample, SampleKey
from fastdraft.databuffer.sequence_loss import per_sequence_mean, shifted_valid, token_ce_loss
from fastdraft.databuffer.spill import (
    Manifest,
    SpillRecord,
    SpillStore,
    load_records,
    load_spill,
    read_manifest,
)

__all__ = ["BufferStats", "DataBuffer", "Manifest", "PackedBatch", "Sample", "SampleKey",
           "SpillRecord", "SpillStore", "block_causal_mask", "load_records", "load_spill",
           "longest_tail", "pack", "pack_rows", "pad", "per_sequence_mean", "read_manifest",
           "select_offset", "shifted_valid", "token_ce_loss"]
