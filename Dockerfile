# syntax=docker/dockerfile:1
# tokenmill images, one Dockerfile, three targets (docker-compose.yml and deploy/k8s/ use all three):
#   docker build --target gateway -t tokenmill-gateway .  # broker and HTTP gateway: no torch
#   docker build --target cpu     -t tokenmill-cpu .      # a worker (or `tokenmill serve`) on the CPU: the embedded model
#   docker build --target cuda    -t tokenmill-cuda .     # a GPU worker: torch built for CUDA, Triton and what it
#                                                         # compiles with at run time (a C compiler, Python headers)
# Configuration is by environment variables (TOKENMILL_*, one per setting: README.md, "Configuration").
# Mount models under /models; the embedded model is fetched once into the /cache volume.

ARG PYTHON_IMAGE=python:3.11-slim
# The CUDA runtime userspace matching the torch build below (the driver comes from the host through the NVIDIA
# container toolkit).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
# The versions the H200 benchmarks ran (benchmarks/results/h200/): torch's Linux wheel on PyPI carries CUDA.
ARG TORCH_VERSION=2.11.0
ARG TRITON_VERSION=3.6.0

# ---- the project's source (every package the install maps: pyproject.toml, tool.setuptools.package-dir) --------
FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY broker ./broker
COPY client ./client
COPY gateway ./gateway
COPY worker ./worker
COPY kernels ./kernels
COPY cli ./cli
COPY benchmarks ./benchmarks

# ---- broker and gateway: the SDK's dependencies and FastAPI, no torch ------------------------------------------
FROM ${PYTHON_IMAGE} AS gateway
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=source /src /src
RUN pip install "/src[gateway,fast]" \
 && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
RUN useradd --create-home --uid 1000 tokenmill
USER tokenmill
EXPOSE 5555 5556 8000
CMD ["tokenmill", "broker"]

# ---- a worker on the CPU (also runs `tokenmill serve`): torch, the engine's libraries ---------------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION
# An index of CPU-only torch wheels keeps the image ~2 GB smaller: --build-arg TORCH_INDEX_URL=<that index>
ARG TORCH_INDEX_URL=
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENMILL_CACHE=/cache \
    TOKENMILL_DEVICE=cpu
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY --from=source /src /src
RUN pip install "/src[worker,gateway]"
RUN useradd --create-home --uid 1000 tokenmill && mkdir -p /cache /models && chown tokenmill /cache /models
USER tokenmill
VOLUME ["/cache"]
EXPOSE 8000
CMD ["tokenmill", "worker"]

# ---- a GPU worker ------------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS cuda
ARG TORCH_VERSION
ARG TRITON_VERSION
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENMILL_CACHE=/cache TOKENMILL_DEVICE=cuda PATH=/opt/venv/bin:$PATH
# Triton compiles a small launcher for each kernel signature when it first runs: it needs gcc and Python.h.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
RUN pip install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
COPY --from=source /src /src
RUN pip install "/src[worker,gpu,fast]"
RUN useradd --create-home --uid 1001 tokenmill && mkdir -p /cache /models && chown tokenmill /cache /models
USER tokenmill
VOLUME ["/cache"]
CMD ["tokenmill", "worker"]
