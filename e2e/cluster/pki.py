"""Certificates and kubeconfigs of the local cluster: an openssl PKI (EC P-256) and self-contained kubeconfigs.
Standard library only."""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

# The API server's service range; its serving certificate names the first address. Overridable
# (NPUSERVE_SERVICE_CIDR, read when the cluster starts): each InferenceService has a Service, and a /24 holds fewer
# than 254 of them (benchmarks/autotune_scale.py creates 300).
SERVICE_CIDR = os.environ.get("NPUSERVE_SERVICE_CIDR") or "10.0.0.0/24"
SERVICE_IP = str(ipaddress.ip_network(SERVICE_CIDR).network_address + 1)


def _openssl(*args: str, cwd: Path) -> None:
    _quiet_run(["openssl", *args], cwd=cwd)


def _quiet_run(cmd: Sequence[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(list(cmd), cwd=cwd, text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _issue_cert(pki: Path, name: str, subject: str, extensions: str) -> None:
    """An EC P-256 key and a certificate signed by the local CA."""
    (pki / f"{name}.ext").write_text(extensions)
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", "0x" + os.urandom(16).hex(), "-days", "3650", "-sha256",
        "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=pki,
    )  # fmt: skip
    (pki / f"{name}.csr").unlink()
    (pki / f"{name}.ext").unlink()


# The LeaderWorkerSet controller's webhook server reads tls.crt and tls.key from this folder of the PKI.
WEBHOOK_CERT_DIR = "lws-webhook"


def make_pki(pki: Path) -> None:
    """CA, API server serving cert, client certs (admin in system:masters, controller-manager, scheduler), SA key,
    and the serving cert of the LeaderWorkerSet controller's webhooks (`WEBHOOK_CERT_DIR`)."""
    if not shutil.which("openssl"):
        raise RuntimeError("openssl not found (apt-get install openssl)")
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650", "-sha256", "-subj", "/CN=npuserve-local-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    sans = ",".join(
        [
            "IP:127.0.0.1",
            f"IP:{SERVICE_IP}",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )
    server_ext = f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n"
    client_ext = "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n"
    _issue_cert(pki, "apiserver", "/CN=kube-apiserver", server_ext)
    _issue_cert(pki, "admin", "/O=system:masters/CN=npuserve-admin", client_ext)
    _issue_cert(pki, "controller-manager", "/CN=system:kube-controller-manager", client_ext)
    _issue_cert(pki, "scheduler", "/CN=system:kube-scheduler", client_ext)
    # The API server calls the controller's webhooks at https://127.0.0.1:<port>/... (it runs outside any pod, so
    # there is no Service to name); the webhook configurations carry this CA as their caBundle.
    webhook_ext = server_ext.replace(f"subjectAltName={sans}", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    _issue_cert(pki, "lws-webhook", "/CN=lws-webhook", webhook_ext)
    cert_dir = pki / WEBHOOK_CERT_DIR
    cert_dir.mkdir(exist_ok=True)
    (pki / "lws-webhook.crt").rename(cert_dir / "tls.crt")
    (pki / "lws-webhook.key").rename(cert_dir / "tls.key")
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A self-contained kubeconfig (certificates embedded) for one of the client certs."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "npuserve-local",
                "cluster": {"server": server, "certificate-authority-data": _b64(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(pki / f"{user}.crt"),
                    "client-key-data": _b64(pki / f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": "npuserve-local", "context": {"cluster": "npuserve-local", "user": user}}],
        "current-context": "npuserve-local",
    }
    path.write_text(json.dumps(cfg, indent=2) + "\n")  # JSON is YAML
    os.chmod(path, 0o600)
