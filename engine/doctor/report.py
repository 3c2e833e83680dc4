"""What `npuserve doctor` reports: one line per check, a verdict, and the same as JSON (`--json`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["ok", "warn", "fail", "skip"]
MARKS: dict[str, str] = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


class DoctorCheck(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    status: Status
    detail: str


class DoctorReport(BaseModel):
    """Every check in the order it ran; `ok` when none failed; `npu_present` when torch_npu imported and saw a card."""

    checks: list[DoctorCheck]
    npu_present: bool
    ok: bool
    verdict: str = Field(description="one sentence: ready, not ready (naming the failed checks), or no NPU here")

    @classmethod
    def of(cls, checks: list[DoctorCheck], npu_present: bool) -> DoctorReport:
        failed = [c.name for c in checks if c.status == "fail"]
        if not npu_present:
            reason = next((c.detail for c in checks if c.status == "fail"), "no card is visible")
            verdict = f"no NPU is present on this machine: {reason}"
        elif failed:
            verdict = f"not ready: {len(failed)} check(s) failed: {', '.join(failed)}"
        else:
            verdict = "ready: this card runs the npu backend's kernels within their contracts"
        return cls(checks=checks, npu_present=npu_present, ok=not failed, verdict=verdict)

    def failed(self) -> list[DoctorCheck]:
        return [c for c in self.checks if c.status == "fail"]

    def lines(self) -> list[str]:
        width = max((len(c.name) for c in self.checks), default=0)
        out = [f"[{MARKS[c.status]}] {c.name.ljust(width)}  {c.detail}" for c in self.checks]
        out.append(f"verdict: {self.verdict}")
        return out
