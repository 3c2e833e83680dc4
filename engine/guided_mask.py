"""The grammar's token mask, applied to the logits on the device before sampling.

llguidance fills one row of a packed bitmask (32 tokens per int32) for each guided sequence, in parallel on its own
CPU threads; the rows go to the device in one copy, are unpacked there, and set the refused tokens' logits to -inf.
Rows without a grammar are not touched. Greedy and sampled rows alike then choose among the allowed tokens, and
logprobs are those of the masked distribution (the one actually sampled from).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from npuserve.engine.guided import Guide


class GuidedMasker:
    def __init__(self, num_threads: int | None = None) -> None:
        self._executor: object | None = None
        self._num_threads = num_threads
        self._bits: dict[torch.device, torch.Tensor] = {}

    @property
    def executor(self) -> object:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._num_threads)
        return self._executor

    def apply(self, logits: torch.Tensor, guides: Seq[Guide | None]) -> None:
        """Masks `logits` (batch, vocab) in place: row i keeps only the tokens guide i allows."""
        rows = [i for i, g in enumerate(guides) if g is not None]
        if not rows:
            return
        vocab = logits.shape[1]
        words = (vocab + 31) // 32
        packed = torch.full((len(rows), words), -1, dtype=torch.int32)
        matchers = [(guides[i].matcher, k) for k, i in enumerate(rows)]  # type: ignore[union-attr]
        self.executor.unsafe_compute_mask_ptr(matchers, packed.data_ptr(), words * 4, len(rows))  # type: ignore[attr-defined]
        allowed = self._unpack(packed.to(logits.device, non_blocking=True), vocab)
        index = torch.tensor(rows, device=logits.device)
        masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        logits.index_copy_(0, index, masked)

    def _unpack(self, packed: torch.Tensor, vocab: int) -> torch.Tensor:
        """(rows, words) int32 -> (rows, vocab) bool: bit j of word w is token 32 w + j."""
        bits = self._bits.get(packed.device)
        if bits is None:
            bits = torch.arange(32, dtype=torch.int32, device=packed.device)
            self._bits[packed.device] = bits
        return ((packed.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
