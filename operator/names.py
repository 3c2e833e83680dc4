"""Names the operator spells once: the Kubernetes labels it puts on what it renders and selects by (the renderer,
the cluster client and the Prometheus queries alike), and the environment variable that says where its Prometheus
is (the command line's default, and the handlers' when kopf loads them by module name)."""

from __future__ import annotations

INSTANCE_LABEL = "npuserve.io/inferenceservice"
COMPONENT_LABEL = "app.kubernetes.io/component"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # the LeaderWorkerSet controller sets it

PROMETHEUS_URL_ENV = "NPUSERVE_PROMETHEUS_URL"  # `npuserve operator --prometheus-url`'s default
MEMO_PROMETHEUS_URL = "prometheus_url"  # the key of kopf's memo that carries --prometheus-url to the handlers
# The engine container of every engine pod: render names it, kube reads its state (restarts, termination message).
ENGINE_CONTAINER = "engine"
