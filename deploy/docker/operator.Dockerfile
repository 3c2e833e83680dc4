# syntax=docker/dockerfile:1
# The npuserve operator: kopf + the planner and renderer. No torch (`npuserve[operator]` does not pull it).
# Build from the repository root:
#   docker build -f deploy/docker/operator.Dockerfile -t npuserve/operator:0.1.0 .

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

# --- the operator image -----------------------------------------------------------------------------------------
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

COPY --from=wheel /wheels /wheels
# The check runs from / : a working directory holding the source's operator/ folder would shadow the stdlib.
RUN pip install "$(ls /wheels/npuserve-*.whl)[operator]" \
    && rm -rf /wheels \
    && cd / && python -c "import importlib.util as u, kopf, npuserve.operator.render; assert u.find_spec('torch') is None"

# Non-root, matching the chart's podSecurityContext (runAsUser 1000); the chart mounts a writable /tmp.
RUN groupadd --gid 1000 npuserve \
    && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin npuserve
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080

ENTRYPOINT ["npuserve", "operator"]
