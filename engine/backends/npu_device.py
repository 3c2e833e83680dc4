"""Which Ascend card a tensor-parallel rank drives: MindIE's `npuDeviceIds` (logical ids) and the rank, checked
against `ASCEND_RT_VISIBLE_DEVICES`. No torch_npu here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from collections.abc import Sequence as Seq

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"


def parse_visible_devices(value: str | None) -> list[int] | None:
    """`ASCEND_RT_VISIBLE_DEVICES` ("0,1,4") as physical card ids; None when unset or empty."""
    if value is None or not value.strip():
        return None
    cards: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{VISIBLE_DEVICES_ENV}={value!r}: expected comma-separated card ids such as '0,1'")
        cards.append(int(part))
    if len(set(cards)) != len(cards):
        raise ValueError(f"{VISIBLE_DEVICES_ENV}={value!r} names a card twice")
    return cards


def local_device_index(npu_device_ids: Seq[int] | None = None, rank: int = 0,
                       environ: Mapping[str, str] | None = None) -> int:
    """The index this rank passes to `torch.npu.set_device`.

    `npu_device_ids` is one instance's list from MindIE's `BackendConfig.npuDeviceIds`: logical ids, i.e. the
    runtime's numbering. With `ASCEND_RT_VISIBLE_DEVICES` set, the runtime numbers the cards it lists 0..n-1 in the
    listed order (as CUDA_VISIBLE_DEVICES does), so the ids index into that list; unset, logical ids are the
    physical ones. Rank r takes the list's r-th id; without a list, card r.
    """
    if rank < 0:
        raise ValueError(f"rank {rank} is negative")
    ids = list(npu_device_ids) if npu_device_ids is not None else None
    if ids is not None:
        if len(set(ids)) != len(ids):
            raise ValueError(f"npuDeviceIds {ids} names a card twice")
        if any(i < 0 for i in ids):
            raise ValueError(f"npuDeviceIds {ids} has a negative id")
        if rank >= len(ids):
            raise ValueError(f"rank {rank} has no card: npuDeviceIds {ids} lists {len(ids)}")
        index = ids[rank]
    else:
        index = rank
    visible = parse_visible_devices((os.environ if environ is None else environ).get(VISIBLE_DEVICES_ENV))
    if visible is not None and index >= len(visible):
        hint = ""
        if index in visible:
            hint = (f"; physical card {index} is logical id {visible.index(index)} (npuDeviceIds are logical ids, "
                    f"counted within {VISIBLE_DEVICES_ENV})")
        listed = ",".join(map(str, visible))
        raise ValueError(f"card {index} for rank {rank} is not visible: {VISIBLE_DEVICES_ENV}={listed} makes "
                         f"{len(visible)} card(s) visible, ids 0..{len(visible) - 1}{hint}")
    return index
