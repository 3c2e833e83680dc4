"""KWOK: the fake nodes (eight Ascend 910 cards each, loopback pod IPs) and the pod stages of its configuration.
Standard library only."""

from __future__ import annotations

import ipaddress
import os

# The extended resource and the two fake nodes.
ACCELERATOR_RESOURCE = "huawei.com/Ascend910"
NODE_NAMES = ("npu-node-0", "npu-node-1")
NPUS_PER_NODE = 8
# Overridable (NPUSERVE_POD_CIDR) so that two local clusters on one machine (a second one on other ports) give their
# pods different loopback addresses, each engine binding its pod IP's port 8000.
POD_CIDR = os.environ.get("NPUSERVE_POD_CIDR") or "127.1.0.1/16"
POD_NETWORK = ipaddress.ip_network(POD_CIDR, strict=False)  # what a pod IP must lie in
# KWOK manages the nodes with this annotation (the process kubelet runs the engine pods on them).
NODE_ANNOTATION, NODE_ANNOTATION_VALUE = "kwok.x-k8s.io/node", "fake"


def fake_node(name: str, index: int) -> dict[str, object]:
    """A KWOK node: 8 Ascend 910 cards, two NUMA nodes of four cards each (as an Atlas 800 inference server)."""
    resources = {
        "cpu": "192",
        "memory": "1536Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        ACCELERATOR_RESOURCE: str(NPUS_PER_NODE),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {NODE_ANNOTATION: NODE_ANNOTATION_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node-role.kubernetes.io/agent": "",
                "type": "kwok",
                "accelerator": "huawei-Ascend910",  # the label the Ascend device plugin sets
                "npuserve.io/npu-count": str(NPUS_PER_NODE),
                "npuserve.io/numa-nodes": "2",
                "npuserve.io/numa0-npus": "0-3",
                "npuserve.io/numa1-npus": "4-7",
                "topology.kubernetes.io/zone": f"local-{index % 2}",
            },
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": resources},  # KWOK fills in conditions and nodeInfo
    }


# KWOK's pod stages (they replace its default "fast" ones; the node stages stay the defaults). Process pods, whose
# container runs `npuserve serve` (the engine, engine_contract.serve_command) or `npuserve bench` (the load
# generator of the operator's benchmark Jobs), get Running and an IP but not Ready: the process kubelet (kubelet.py)
# runs the command, sets readiness (the engine's /ready; a bench at once) and, for a container that ends and is not
# restarted, the terminated state and the pod's phase. Other pods behave as KWOK's defaults: Ready at once, and a
# Job's pods then Succeeded. Each status stage matches only while the pod has no IP yet, so KWOK plays it once and
# never overwrites the kubelet's patches afterwards.
ENGINE_POD_QUERY = (
    '.spec.containers[] | (.command // []) | select(length >= 2) | (.[0] | split("/") | last) + " " + .[1]'
)
PROCESS_COMMANDS = ("npuserve serve", "npuserve bench")
_PROCESS_VALUES = "[" + ", ".join(f"'{c}'" for c in PROCESS_COMMANDS) + "]"
_POD_STATUS_COMMON = """
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        state:
          terminated:
            exitCode: 0
            finishedAt: {{ $now | Quote }}
            reason: Completed
            startedAt: {{ $now | Quote }}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
(or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
"""


def _stage_head(name: str) -> str:
    """A KWOK Stage for pods, up to the match expressions of its selector."""
    return f"""---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: {name}
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
"""


def _pod_stage(name: str, engine: bool) -> str:
    ready, reason = ("False", "\n        reason: ContainersNotReady") if engine else ("True", "")
    state = (
        "waiting:\n            reason: ContainerCreating"
        if engine
        else "running:\n            startedAt: {{ $now | Quote }}"
    )
    return (
        _stage_head(name)
        + f"""    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.podIP'
      operator: 'DoesNotExist'
    - key: '{ENGINE_POD_QUERY}'
      operator: '{"In" if engine else "NotIn"}'
      values: {_PROCESS_VALUES}
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "{ready}"
        type: Ready{reason}
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "{ready}"
        type: ContainersReady{reason}
      {{{{ range .spec.readinessGates }}}}
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: {{{{ .conditionType | Quote }}}}
      {{{{ end }}}}
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: {"false" if engine else "true"}
        restartCount: 0
        state:
          {state}
      {{{{ end }}}}"""
        + _POD_STATUS_COMMON
    )


def _not_process_pod() -> str:
    """A match expression for pods the process kubelet does not run."""
    return f"""    - key: '{ENGINE_POD_QUERY}'
      operator: 'NotIn'
      values: {_PROCESS_VALUES}
"""


def kwok_pod_stages() -> str:
    """KWOK Stage documents for pods: process pods Running but not Ready, others Ready; Job pods that are not
    process pods complete; deleted pods go at once (KWOK's fast stages otherwise)."""
    complete = _stage_head("pod-complete") + """    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.metadata.ownerReferences.[].kind'
      operator: 'In'
      values: ['Job']
""" + _not_process_pod() + """  next:
    statusTemplate: |
      {{ $now := Now }}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 0
            finishedAt: {{ $now | Quote }}
            reason: Completed
            startedAt: {{ $now | Quote }}
      {{ end }}
      phase: Succeeded
"""
    delete = _stage_head("pod-delete") + """    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
  next:
    finalizers:
      empty: true
    delete: true
"""
    return _pod_stage("pod-ready", engine=False) + _pod_stage("process-pod-running", engine=True) + complete + delete


def kwok_config() -> str:
    """KWOK's configuration file: default options, our pod stages."""
    return "apiVersion: config.kwok.x-k8s.io/v1alpha1\nkind: KwokConfiguration\noptions: {}\n" + kwok_pod_stages()
