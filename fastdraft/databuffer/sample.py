"""Sample: one finished rollout's tokens and the policy's hidden states, as the DataBuffer holds it.

Hidden state t is the policy's final (normed) hidden state after reading token t, the feature the
EAGLE drafter pairs with token t + 1 (see drafter/losses.py). Tensors are normalised once, here,
to what the buffer stores: host memory, int64 ids and positions, bool loss mask, bf16 hidden
states, each owning exactly its own storage, so `nbytes` is the memory the sample really pins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fastdraft.errors import FastdraftError

#: Identifies a sample for `DataBuffer.set_reward`: (rl_step, request_index). The RL step is part
#: of the key because request indices restart every step in the engine.
SampleKey = tuple[int, int]
#: One window of a sample (Sample.window_key): (rl_step, request_index, first position). A long
#: rollout is held as several windows; they share the SampleKey (one reward) and differ here.
WindowKey = tuple[int, int, int]

HIDDEN_DTYPE = torch.bfloat16


def _owned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t on the host in `dtype`, contiguous and owning exactly its bytes: a slice of a larger
    step-wide tensor would otherwise keep the whole tensor alive and make `nbytes` a lie."""
    t = t.detach().to(device="cpu", dtype=dtype)
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.contiguous().clone()
    return t


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One finished rollout (prompt + answer), T tokens, hidden size H.

    token_ids [T] int64; positions [T] int64 (RoPE positions, normally 0..T-1);
    hidden [T, H] bf16 final hidden states; aux_hidden: EAGLE-3 layer inputs, each [T, H] bf16
    (empty for EAGLE-1); loss_mask [T] bool, True at the answer tokens to train on;
    reward: None until the rollout is scored (`DataBuffer.set_reward`).
    The tensors are shared, never copied, by the buffer and its batches: do not mutate them.
    """

    request_index: int
    policy_version: int
    rl_step: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: tuple[torch.Tensor, ...] = ()
    reward: float | None = None

    def __post_init__(self) -> None:
        for name in ("token_ids", "positions", "hidden", "loss_mask"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise FastdraftError(f"Sample.{name} must be a torch.Tensor")
        if self.token_ids.dim() != 1 or self.token_ids.numel() == 0:
            raise FastdraftError(f"Sample.token_ids must be [T] with T >= 1, got shape "
                                 f"{tuple(self.token_ids.shape)}")
        if self.token_ids.is_floating_point() or self.token_ids.dtype == torch.bool:
            raise FastdraftError(f"Sample.token_ids must hold integers, got {self.token_ids.dtype}")
        num_tokens = self.token_ids.numel()
        if self.positions.shape != (num_tokens,) or self.positions.is_floating_point():
            raise FastdraftError(f"Sample.positions must be integer [{num_tokens}], got "
                                 f"{self.positions.dtype} {tuple(self.positions.shape)}")
        if self.loss_mask.shape != (num_tokens,):
            raise FastdraftError(f"Sample.loss_mask must be [{num_tokens}], got "
                                 f"{tuple(self.loss_mask.shape)}")
        if self.hidden.dim() != 2 or self.hidden.shape[0] != num_tokens:
            raise FastdraftError(f"Sample.hidden must be [{num_tokens}, H], got "
                                 f"{tuple(self.hidden.shape)}")
        if not self.hidden.is_floating_point():
            raise FastdraftError(f"Sample.hidden must be floating point, got {self.hidden.dtype}")
        aux = tuple(self.aux_hidden)
        for i, a in enumerate(aux):
            if not isinstance(a, torch.Tensor) or a.shape != self.hidden.shape:
                raise FastdraftError(f"Sample.aux_hidden[{i}] must be a tensor shaped like hidden "
                                     f"{tuple(self.hidden.shape)}")
        if self.reward is not None:
            reward = float(self.reward)
            if not math.isfinite(reward):
                raise FastdraftError(f"Sample.reward must be finite or None, got {self.reward}")
            object.__setattr__(self, "reward", reward)
        set_ = object.__setattr__
        set_(self, "token_ids", _owned(self.token_ids, torch.int64))
        set_(self, "positions", _owned(self.positions, torch.int64))
        set_(self, "loss_mask", _owned(self.loss_mask, torch.bool))
        set_(self, "hidden", _owned(self.hidden, HIDDEN_DTYPE))
        set_(self, "aux_hidden", tuple(_owned(a, HIDDEN_DTYPE) for a in aux))

    @property
    def key(self) -> SampleKey:
        return (self.rl_step, self.request_index)

    @property
    def start(self) -> int:
        """The first position held (0 unless the sample is a later window of a rollout)."""
        return int(self.positions[0])

    @property
    def window_key(self) -> WindowKey:
        return (self.rl_step, self.request_index, self.start)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def hidden_size(self) -> int:
        return self.hidden.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the sample holds (what the buffer's capacity counts)."""
        tensors = (self.token_ids, self.positions, self.hidden, self.loss_mask, *self.aux_hidden)
        return sum(t.nbytes for t in tensors)

    def with_reward(self, reward: float | None) -> Sample:
        return replace(self, reward=reward)

    def with_loss_mask(self, loss_mask: torch.Tensor) -> Sample:
        return replace(self, loss_mask=loss_mask)

    def truncated(self, num_tokens: int) -> Sample:
        """The first num_tokens tokens (prompt first, so the prompt survives a cut): used when a
        sample is longer than a whole batch's token budget."""
        if not 1 <= num_tokens <= self.num_tokens:
            raise FastdraftError(f"cannot truncate a {self.num_tokens}-token sample to "
                                 f"{num_tokens}")
        return self.window(0, num_tokens)

    def window(self, begin: int, end: int) -> Sample:
        """Tokens [begin, end) with their own positions, hidden states and loss mask (views:
        `_owned` copies them to their own storage, so the window pins only its bytes)."""
        if not 0 <= begin < end <= self.num_tokens:
            raise FastdraftError(f"window [{begin}, {end}) is not inside a {self.num_tokens}-token "
                                 "sample")
        if (begin, end) == (0, self.num_tokens):
            return self
        cut = slice(begin, end)
        return replace(self, token_ids=self.token_ids[cut], positions=self.positions[cut],
                       hidden=self.hidden[cut], loss_mask=self.loss_mask[cut],
                       aux_hidden=tuple(a[cut] for a in self.aux_hidden))
