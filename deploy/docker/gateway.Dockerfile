# syntax=docker/dockerfile:1.7
# The gateway alone: no torch, no vLLM (workers run in their own images). About 250 MB.
# Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t vllm-gateway:0.1.0 .
# Run (the config must name workers by URL, e.g. deploy/compose/gateway.yaml):
#   docker run --read-only --tmpfs /tmp -p 8000:8000 -v "$PWD/deploy/compose/gateway.yaml:/etc/gateway/config.yaml:ro" vllm-gateway:0.1.0
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/gateway
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY plugins ./plugins
# `pip install .` without the engine extra: the gateway never imports torch or vLLM unless it starts
# managed workers itself, which it does not here (GATEWAY_MANAGED_WORKERS=false).
RUN /opt/gateway/bin/pip install . \
    && /opt/gateway/bin/python -m compileall -q /opt/gateway/lib

FROM python:${PYTHON_VERSION}-slim-bookworm
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --home-dir /home/gateway --create-home gateway
COPY --from=build /opt/gateway /opt/gateway
# The default config (the compose stack's); Kubernetes mounts its ConfigMap over /etc/gateway.
COPY deploy/compose/gateway.yaml /etc/gateway/config.yaml
ENV PATH=/opt/gateway/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/gateway \
    XDG_CACHE_HOME=/tmp/.cache \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8000 \
    GATEWAY_CONFIG_PATH=/etc/gateway/config.yaml \
    GATEWAY_MANAGED_WORKERS=false \
    GATEWAY_WORKERS=1
# Nothing is written outside /tmp: run with a read-only root filesystem and /tmp as a tmpfs/emptyDir.
USER 10001:10001
WORKDIR /home/gateway
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('GATEWAY_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["gateway", "serve"]
