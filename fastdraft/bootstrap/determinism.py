"""Bit-reproducible CPU training of the bootstrap policy, and a digest to prove it.

What decides the trained weights, and how each is pinned:

* Randomness: the weight init draws from a torch generator seeded with the bootstrap seed inside
  ``torch.random.fork_rng`` (the caller's global RNG state neither matters nor changes); the data
  comes from a ``random.Random`` seeded with a string (Python hashes it with SHA-512, so
  ``PYTHONHASHSEED`` plays no part); the model has no dropout and training samples nothing else.
  Nothing iterates over a set or a dict keyed by ``hash()``, and no time enters any decision.
* Reduction order: CPU kernels (MKL GEMMs, ATen reductions, SDPA) split their work by thread
  count, so a different ``torch.get_num_threads()`` sums floats in another order. Training runs
  with ``BootstrapSpec.num_threads`` intra-op threads whatever the caller or ``OMP_NUM_THREADS``
  set (restored afterwards); the count is part of the spec digest and of the report.
* Precision: fp32 matmuls are pinned to IEEE fp32 (no oneDNN bf16/tf32 shortcut that another
  component of the process may have allowed), and ``torch.use_deterministic_algorithms`` is on.

Not guaranteed (the report records ``torch_version``, ``cpu_capability`` and ``torch_threads``
next to ``weights_digest`` so that a mismatch can be traced): other torch / MKL builds, and other
CPUs. ATen dispatches vectorised kernels by instruction set (AVX2 vs AVX-512: see
``torch.backends.cpu.get_cpu_capability()``; ``ATEN_CPU_CAPABILITY=avx2`` set before torch is
imported pins it) and MKL picks its GEMM code path per CPU model and vendor (``MKL_CBWR`` set
before torch is imported pins that, at a large speed cost), so two machines can differ in the
last bits of a GEMM and a few hundred optimiser steps amplify that into different weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastdraft.errors import FastdraftError
from fastdraft.utils.digest import tensor_digest


@contextmanager
def deterministic_cpu(num_threads: int) -> Iterator[None]:
    """Runs the block with ``num_threads`` intra-op threads, deterministic algorithms on and IEEE
    fp32 matmuls; the previous settings come back afterwards, even on error."""
    if num_threads < 1:
        raise FastdraftError(f"num_threads={num_threads}: use 1 or more")
    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              getattr(mkldnn_matmul, "fp32_precision", None))
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    if mkldnn_matmul is not None:
        mkldnn_matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        threads, enabled, warn_only, precision = before
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if mkldnn_matmul is not None:
            mkldnn_matmul.fp32_precision = precision


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 (first 16 hex digits) of every parameter's name, dtype, shape and bytes, in name
    order; tied parameters count once. Equal digests mean bit-identical weights."""
    return tensor_digest(model.named_parameters())


def runtime_info() -> dict[str, str]:
    """What besides the spec can change the weights' last bits: torch build and CPU dispatch."""
    return {"torch_version": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
