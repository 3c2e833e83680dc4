"""The engine's decode step at batch 64 on the CPU (the tiny dummy model), and the output processing's time
(incremental detokenization, stop-string checks, `RequestOutput` assembly) against it.

Two runs in one process, same engine, same prompts: requests with stop strings (that never match, so every request
runs its whole length), and the same requests without. Per decode step it reports the step thread's wall time
(median over the steps of a batch of 64), the runner's part (the step's `StepStats.seconds`), the step thread's
time outside the runner ("host ms": less noisy than the step, whose forward pass is most of it), and the time spent
in the output processor; no wall time is asserted, these machines are shared and noisy. Where the engine has
`run_step()` the output processor runs apart from the step (the server's output thread) and is timed apart; before
that split it ran inside `step()`, on the step thread, and is timed there.

    .venv/bin/python benchmarks/decode_step.py [--batch 64] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STOP_STRINGS = ("\n\nQuestion:", "<|stop-here|>", "The answer is 42.")  # long enough never to be sampled


@dataclass(slots=True)
class DecodeSteps:
    step_ms: list[float]  # the step thread's wall time per decode step
    runner_ms: list[float]  # of which the runner (swap, forward, sampling, scheduler update)
    output_ms: list[float]  # of which the output processor, on the step thread

    def summary(self) -> tuple[float, float, float, float]:
        """Medians: step, runner, output processing, and the step thread's time outside the runner (per step,
        less noisy than the step itself on a shared machine: the forward pass is most of it)."""
        host = [s - r for s, r in zip(self.step_ms, self.runner_ms, strict=True)]
        return (statistics.median(self.step_ms), statistics.median(self.runner_ms),
                statistics.median(self.output_ms), statistics.median(host))


def _timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    return wrapper


def run_batch(engine: Any, batch: int, max_tokens: int, stop: tuple[str, ...]) -> DecodeSteps:
    """`batch` requests at once, stepped by hand until all end; only full-batch decode steps are kept."""
    from npuserve.engine.scheduler import StepKind
    from npuserve.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True, stop=stop)
    for i in range(batch):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", f"Question {i}: how many apples are left if you eat "
                           f"{i % 7} of {i + 10}?", params)
    split = hasattr(engine, "run_step")  # the step thread hands raw updates to the output side
    spent: list[float] = []
    if not split:  # the output processor runs inside step(): time it there
        engine.outputs.process = _timed(engine.outputs.process, spent)
    result = DecodeSteps([], [], [])
    try:
        while engine.has_unfinished():
            spent.clear()
            t0 = time.perf_counter()
            step = engine.run_step() if split else engine.step()
            wall = time.perf_counter() - t0
            if split:  # what the server's output thread does with it, timed apart
                _timed(engine.outputs.process, spent)(step.updates)
            stats = step.stats
            if stats is not None and stats.kind is StepKind.DECODE and stats.num_seqs == batch:
                result.step_ms.append(wall * 1e3)
                result.runner_ms.append(stats.seconds * 1e3)
                result.output_ms.append(sum(spent) * 1e3)
    finally:
        if not split:
            del engine.outputs.process  # the instance attribute: the class's method again
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternated; medians reported")
    args = parser.parse_args()

    from npuserve.catalog import get_model_preset
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.model.dummy import write_dummy_model
    from npuserve.mindie_config import minimal_config

    with tempfile.TemporaryDirectory() as tmp:
        model = write_dummy_model(get_model_preset("tiny"), Path(tmp) / "tiny", seed=0)
        config = minimal_config(model, max_seq_len=512, maxBatchSize=args.batch, maxPrefillBatchSize=args.batch,
                                maxPrefillTokens=16384, extensions={"device": "cpu"})
        engine = LLMEngine(config)
        run_batch(engine, 8, 8, STOP_STRINGS)  # warm caches
        runs: dict[str, list[tuple[float, float, float, float]]] = {"stop strings": [], "no stop strings": []}
        for _ in range(args.repeats):
            runs["stop strings"].append(run_batch(engine, args.batch, args.max_tokens, STOP_STRINGS).summary())
            runs["no stop strings"].append(run_batch(engine, args.batch, args.max_tokens, ()).summary())
        engine.close()

    print(f"tiny dummy model on the CPU, batch {args.batch}, {args.max_tokens} output tokens, "
          f"{args.repeats} runs each (medians of the per-run medians)")
    where = "off the step thread" if hasattr(engine, "run_step") else "on the step thread"
    print(f"output processing: {where}; output share = output ms / step ms")
    print(f"{'requests':<17} {'step ms':>8} {'runner ms':>10} {'host ms':>8} {'output ms':>10} {'output share':>13}")
    figures = {}
    for name, summaries in runs.items():
        step, runner, output, host = (statistics.median(s[k] for s in summaries) for k in range(4))
        figures[name] = step
        print(f"{name:<17} {step:8.2f} {runner:10.2f} {host:8.2f} {output:10.2f} {output / step:12.1%}")
    print(f"step time, stop strings / none: {figures['stop strings'] / figures['no stop strings']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
