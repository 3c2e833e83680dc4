"""The planning core (docs/architecture.md): pure functions from an InferenceService to what the engines should run.

No cluster, no Prometheus, no engine, no torch: the operator wraps these in kopf handlers and Kubernetes I/O, the
simulator runs them against a virtual engine (`npuserve simulate`, `npuserve tune --simulate`), and both import
them downward; nothing here imports either.

    api            the InferenceService API (spec, plan and status types) the others take and give
    planner        spec -> Plan: worldSize, npuMemSize, KV blocks, batch limits, the engine config
    problem        the tuning problem an InferenceService poses and the judge of one window's figures
    fits           the curve fits the tuner reads throughput and latency from
    tuner          decide: the search for the schedule with the most throughput that meets the objective
    tuning_status  the trials and the verdict as status.tuning shows them
"""
