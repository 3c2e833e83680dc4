"""A local Kubernetes control plane without containers, for the end-to-end tests (DESIGN.md section 6).

The names the rest of the repository uses, from the modules beside this one: `binaries` (build and install the
binaries), `processes` (start, record and stop processes), `pki` (certificates, kubeconfigs), `kwok` (fake nodes,
pod stages) and `lifecycle` (`Cluster`, `up`/`down`, `acquire`/`release`). Standard library only.

Import it by path (its folder on sys.path) or run it through `cluster.py`; never put the repository root on
sys.path, its `operator/` folder shadows the standard library module.
"""

from __future__ import annotations

from binaries import (
    GO_TOOLCHAIN,
    HELM_VERSION,
    K8S_BINARIES,
    K8S_VERSION,
    KWOK_VERSION,
    REPO_ROOT,
    Binaries,
    build_kubernetes,
    cache_dir,
    default_npuserve,
    ensure_binaries,
    find_etcd,
    helm_bin_dir,
    install_helm,
    install_kwok,
    k8s_bin_dir,
    kwok_bin_dir,
    staging_modules,
    wrapper_go_mod,
)
from kwok import (
    ACCELERATOR_RESOURCE,
    ENGINE_POD_QUERY,
    NODE_NAMES,
    NPUS_PER_NODE,
    POD_CIDR,
    fake_node,
    kwok_config,
    kwok_pod_stages,
)
from lifecycle import (
    COMPONENTS,
    PORT_DEFAULTS,
    Cluster,
    acquire,
    current,
    down,
    ports_from_env,
    release,
    state_dir,
    status,
    up,
)
from pki import SERVICE_CIDR, SERVICE_IP, make_pki, write_kubeconfig
from processes import log

__all__ = [
    "ACCELERATOR_RESOURCE",
    "COMPONENTS",
    "ENGINE_POD_QUERY",
    "GO_TOOLCHAIN",
    "HELM_VERSION",
    "K8S_BINARIES",
    "K8S_VERSION",
    "KWOK_VERSION",
    "NODE_NAMES",
    "NPUS_PER_NODE",
    "POD_CIDR",
    "PORT_DEFAULTS",
    "REPO_ROOT",
    "SERVICE_CIDR",
    "SERVICE_IP",
    "Binaries",
    "Cluster",
    "acquire",
    "build_kubernetes",
    "cache_dir",
    "current",
    "default_npuserve",
    "down",
    "ensure_binaries",
    "fake_node",
    "find_etcd",
    "helm_bin_dir",
    "install_helm",
    "install_kwok",
    "k8s_bin_dir",
    "kwok_bin_dir",
    "kwok_config",
    "kwok_pod_stages",
    "log",
    "make_pki",
    "ports_from_env",
    "release",
    "staging_modules",
    "state_dir",
    "status",
    "up",
    "wrapper_go_mod",
    "write_kubeconfig",
]
