# syntax=docker/dockerfile:1.7
#
# Two images from one file, both non-root, on a pinned slim Python base:
#
#   docker build --target operator -t ckpt-operator .   # the kopf operator: no torch, no numpy
#   docker build --target agent    -t ckpt-agent    .   # the in-pod agent / sidecar (torch)
#
# (`buildah bud` takes the same arguments.) Build arguments: PYTHON_IMAGE (the base: any
# image with python>=3.11 and pip on PATH), VERSION, PIP_INDEX_URL, TORCH_INDEX_URL (agent).
# scripts/build-images.sh builds the operator image without a Docker engine or registry
# access (buildah, on a Debian base made with mmdebstrap); see docs/testing.md.
#
# Wheels are built in throw-away stages; the final stages install them from a bind mount
# without network access, so the runtime layers hold no build tools, caches or wheels.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# --------------------------------------------------------------------------- base
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
# The runtime user has a passwd entry: kopf names its peering identity after
# getpass.getuser(), which fails for a uid that /etc/passwd does not know.
RUN groupadd --gid 65532 ckpt \
    && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin ckpt
WORKDIR /app

# --------------------------------------------------------------------------- sources
FROM base AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY agent ./agent
COPY operator ./operator

# --------------------------------------------------------------------------- operator wheels
FROM source AS operator-wheels
# A package index other than PyPI, if any: --build-arg PIP_INDEX_URL=https://pypi.example/simple
ARG PIP_INDEX_URL
# The runtime dependencies are exactly the lock's (pinned, sha256-checked, wheels only: no
# compiler); regenerate it with scripts/lock-operator.sh. Then this project's own wheel.
RUN pip wheel --wheel-dir /wheels --only-binary=:all: --require-hashes \
        -r requirements/operator.lock \
    && pip wheel --wheel-dir /wheels --no-deps .

# --------------------------------------------------------------------------- agent wheels
FROM source AS agent-wheels
ARG PIP_INDEX_URL
# CPU wheels by default; pass e.g. https://download.pytorch.org/whl/cu124 for CUDA.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip wheel --wheel-dir /wheels --extra-index-url "${TORCH_INDEX_URL}" ".[agent]"

# --------------------------------------------------------------------------- operator image
FROM base AS operator
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ckpt-operator" \
      org.opencontainers.image.source="https://github.com/ckpt-operator/ckpt-operator" \
      org.opencontainers.image.description="Kubernetes operator: agent injection, auto-resume, retention" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# the locked wheels (hashes checked again), then the project: nothing else may be needed
RUN --mount=type=bind,from=operator-wheels,source=/wheels,target=/wheels \
    --mount=type=bind,from=source,source=/src/requirements,target=/requirements \
    pip install --no-index --find-links=/wheels --require-hashes -r /requirements/operator.lock \
    && pip install --no-index --find-links=/wheels "ckpt-operator[operator]==${VERSION}" \
    && pip check \
    && python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'numpy')))"
USER 65532:65532
# 8080 health probes, 9090 metrics, 9443 admission webhooks (HTTPS)
EXPOSE 8080 9090 9443
ENTRYPOINT ["ckpt-operator"]

# --------------------------------------------------------------------------- agent image
FROM base AS agent
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ckpt-agent" \
      org.opencontainers.image.source="https://github.com/ckpt-operator/ckpt-operator" \
      org.opencontainers.image.description="ckpt-operator in-pod checkpoint agent and sidecar" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN --mount=type=bind,from=agent-wheels,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "ckpt-operator[agent]==${VERSION}"
USER 65532:65532
EXPOSE 9400
ENTRYPOINT ["ckpt"]
