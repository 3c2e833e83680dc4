# syntax=docker/dockerfile:1
# The npuserve engine on Ascend 910B: CANN + torch + torch_npu + npuserve[engine].
# Build from the repository root:
#   docker build -f deploy/docker/engine.Dockerfile -t npuserve/engine:0.1.0 .
#
# Base: Ascend's public CANN image (github.com/Ascend/cann-container-image, also on Docker Hub as ascendai/cann):
# CANN 8.5.0 (toolkit, 910b ops, NNAL) for Atlas 800 A2 / 910B, Ubuntu 22.04, Python 3.11.14 in
# /usr/local/python3.11.14 (first on PATH). Multi-arch (linux/arm64 for Kunpeng hosts, linux/amd64).
# The image sets CANN's environment with ENV (LD_LIBRARY_PATH, ASCEND_*), so it holds when a pod's `command`
# replaces the entrypoint, as operator/render.py's engine pods do. The driver (libascend_hal, npu-smi) comes from
# the host at run time through the Ascend device plugin.
ARG CANN_IMAGE=quay.io/ascend/cann:8.5.0-910b-ubuntu22.04-py3.11

# --- the npuserve wheel (pure Python) ---------------------------------------------------------------------------
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY npuserve/ npuserve/
COPY engine/ engine/
COPY planning/ planning/
COPY operator/ operator/
COPY loadgen/ loadgen/
COPY sim/ sim/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- the engine image -------------------------------------------------------------------------------------------
FROM ${CANN_IMAGE}

# torch and torch_npu must match each other and CANN. Ascend Extension for PyTorch (op-plugin) 7.3.0 pairs CANN 8.5.0
# with torch 2.8.0 and torch_npu 2.8.0.post2 (Python 3.9-3.12; Ascend/pytorch COMPATIBILITY.en.md); the base image
# carries NNAL 8.5.0 (libatb.so, the ATB operators the npu backend calls) with ATB_HOME_PATH and LD_LIBRARY_PATH set
# by ENV. Supported stacks: docs/engine.md "Supported versions" (op-plugin 7.0.0 to 26.1.0); another pairing of that
# table works with these three arguments and CANN_IMAGE changed together. The build checks the torch_npu is one of
# the matrix's; on a card, `docker run ... npuserve/engine:<tag> doctor` checks the rest (driver, NNAL, each kernel).
ARG TORCH_VERSION=2.8.0
ARG TORCH_NPU_VERSION=2.8.0.post2
ARG ENGINE_UID=1000

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# jemalloc: operator/render.py preloads /usr/local/lib/libjemalloc.so.2 (LD_PRELOAD) when spec.host.jemalloc is on.
# Ubuntu installs it under the multiarch directory; link it to the fixed path on every architecture.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install --no-install-recommends -y libjemalloc2 \
    && ln -sf "$(dpkg -L libjemalloc2 | grep '/libjemalloc\.so\.2$' | head -n 1)" /usr/local/lib/libjemalloc.so.2 \
    && test -e /usr/local/lib/libjemalloc.so.2 \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*

# torch from PyTorch's CPU index (the NPU backend is torch_npu; no CUDA libraries), then torch_npu from PyPI,
# then npuserve[engine] with torch held at the same version.
COPY --from=wheel /wheels /wheels
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && pip install "torch_npu==${TORCH_NPU_VERSION}" \
    && echo "torch==${TORCH_VERSION}" > /tmp/constraints.txt \
    && pip install --constraint /tmp/constraints.txt "$(ls /wheels/npuserve-*.whl)[engine]" \
    && rm -rf /wheels /tmp/constraints.txt \
    && cd / && TORCH_DEVICE_BACKEND_AUTOLOAD=0 python3 -c "import torch, npuserve.engine; print(torch.__version__)" \
    && python3 -c "from npuserve.engine.backends.npu_stack import release_of, torch_for; \
v = '${TORCH_NPU_VERSION}'; r = release_of(v); \
assert r is not None, f'torch_npu {v} is outside the supported matrix'; \
assert torch_for(v) == '${TORCH_VERSION}', f'torch_npu {v} needs torch {torch_for(v)}'; \
print(f'torch_npu {v}: op-plugin {r.name}, CANN and NNAL {r.cann}')"

# Non-root: uid/gid 1000 is HwHiAiUser on Ascend hosts, the owner of the driver's device files (render.py's
# ENGINE_UID). Pods run with a read-only root filesystem and HOME=/tmp (an emptyDir).
RUN groupadd --gid ${ENGINE_UID} HwHiAiUser \
    && useradd --uid ${ENGINE_UID} --gid ${ENGINE_UID} --create-home --shell /bin/bash HwHiAiUser
USER 1000:1000
WORKDIR /home/HwHiAiUser
EXPOSE 8000

ENTRYPOINT ["npuserve"]
CMD ["--help"]
