"""The grammar's token mask: filled on the host when the step is built, applied to the logits on the device.

`GuidedMasker.fill` (the step builder's) has llguidance fill one row of a packed bitmask (32 tokens per int32) for
each guided sequence, in parallel on its own CPU threads; `apply_bitmask` (the runner's) sends the rows to the
device in one copy, unpacks them there and sets the refused tokens' logits to -inf. Rows without a grammar are not
touched. Greedy and sampled rows alike then choose among the allowed tokens, and logprobs are those of the masked
distribution (the one actually sampled from).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from npuserve.engine.guided import Guide


class GuidedMasker:
    def __init__(self, num_threads: int | None = None) -> None:
        self._executor: object | None = None
        self._num_threads = num_threads

    @property
    def executor(self) -> object:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._num_threads)
        return self._executor

    def fill(self, guides: Seq[Guide], vocab_size: int) -> torch.Tensor:
        """(len(guides), ceil(vocab / 32)) int32 on the host: bit j of word w of row i is whether guide i allows
        token 32 w + j."""
        words = (vocab_size + 31) // 32
        packed = torch.full((len(guides), words), -1, dtype=torch.int32)
        if guides:
            matchers = [(g.matcher, k) for k, g in enumerate(guides)]
            self.executor.unsafe_compute_mask_ptr(matchers, packed.data_ptr(), words * 4, len(guides))  # type: ignore[attr-defined]
        return packed


_BITS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, rows: Seq[int], packed: torch.Tensor) -> None:
    """Masks `logits` (batch, vocab) in place: row `rows[k]` keeps only the tokens bitmask row k allows."""
    if not rows:
        return
    vocab = logits.shape[1]
    allowed = _unpack(packed.to(logits.device, non_blocking=True), vocab)
    index = torch.tensor(list(rows), device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)


def _unpack(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, words) int32 -> (rows, vocab) bool: bit j of word w is token 32 w + j."""
    bits = _BITS.get(packed.device)
    if bits is None:
        bits = _BITS[packed.device] = torch.arange(32, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
