"""The simulated engine (docs/simulator.md): the real scheduler and KV manager on a virtual clock priced by a cost
model. No torch: `npuserve simulate` runs with only the operator's dependencies installed.

    from npuserve.sim import SimulationConfig, simulate
    result = simulate(SimulationConfig(engine=mindie_config, model=spec, accelerator="ascend-910b4",
                                       bench=bench_config, num_kv_blocks=2176))
    result.bench            # a loadgen BenchResult (simulated=True): loadgen.metrics and the reports read it
    result.steps[0].cost    # one step's cost breakdown (weights, KV, compute, overheads, communication, swap)
"""

from .cost_model import FITTED_COST_PARAMS, CostModel, CostParams, Hardware, StepCost, StepShape
from .engine import SimulationConfig, SimulationResult, draw_requests, simulate, sweep
from .lengths import OutputLengths
from .runner import SimRequest, StepRecord

__all__ = [
    "FITTED_COST_PARAMS",
    "CostModel",
    "CostParams",
    "Hardware",
    "OutputLengths",
    "SimRequest",
    "SimulationConfig",
    "SimulationResult",
    "StepCost",
    "StepRecord",
    "StepShape",
    "draw_requests",
    "simulate",
    "sweep",
]
