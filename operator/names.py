"""Names the operator spells once: the Kubernetes labels it puts on what it renders and selects by (the renderer,
the cluster client and the Prometheus queries alike), and the environment variable that says where its Prometheus
is (the command line's default, and the handlers' when kopf loads them by module name)."""

from __future__ import annotations

INSTANCE_LABEL = "npuserve.io/inferenceservice"
COMPONENT_LABEL = "app.kubernetes.io/component"
# The LeaderWorkerSet controller's pod webhook sets these on the pods of a group (sigs.k8s.io/lws v0.7.0,
# api/leaderworkerset/v1/leaderworkerset_types.go): the pod's index in its group (0: the leader), the group's index
# in the set, and a key unique to the group (a hash), on the leader and on every worker alike.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"

PROMETHEUS_URL_ENV = "NPUSERVE_PROMETHEUS_URL"  # `npuserve operator --prometheus-url`'s default
MEMO_PROMETHEUS_URL = "prometheus_url"  # the key of kopf's memo that carries --prometheus-url to the handlers
# The engine container of every engine pod: render names it, kube reads its state (restarts, termination message).
ENGINE_CONTAINER = "engine"
