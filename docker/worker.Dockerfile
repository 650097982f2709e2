# syntax=docker/dockerfile:1.7
# Gearshift worker image: CUDA PyTorch + the gearshift package. One container per node of a worker
# group; the operator runs it as `gearshift worker --config /etc/gearshift/engine.json`.
#
#   docker build -f docker/worker.Dockerfile -t ghcr.io/gearshift/worker:0.1.0 .
#
# The CUDA runtime, cuBLAS and NCCL come inside the torch wheels (the cu128 index); the node's
# NVIDIA driver is mounted by the NVIDIA container toolkit. Triton compiles its launcher stubs
# with the system C compiler at run time, and the CPU kernels (gearshift.worker.kernels) are
# built on first use by `c++` through torch's cpp_extension, hence gcc and g++ in the final image.

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VERSION
ARG TORCH_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gearshift
ENV PATH=/opt/gearshift/bin:$PATH
# torch first, from the CUDA index, so the `worker` extra's `torch>=2.5` is already satisfied.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY operator ./operator
COPY proto ./proto
RUN pip install ".[worker]" && pip check

FROM python:${PYTHON_VERSION}-slim-bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/gearshift /opt/gearshift
ENV PATH=/opt/gearshift/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/gearshift \
    HF_HOME=/home/gearshift/.cache/huggingface \
    TRITON_CACHE_DIR=/home/gearshift/.cache/triton
RUN useradd --uid 1000 --create-home --home-dir /home/gearshift gearshift
# Under the operator the pod runs as this user with a read-only root filesystem; what the engine
# writes is mounted: /tmp, /var/cache/gearshift (GEARSHIFT_KERNEL_CACHE, TRITON_CACHE_DIR and
# HF_HOME point there) and /dev/shm (docs/operator.md, "Security").
USER 1000
# Worker gRPC (leader) + grpc.health.v1 (every rank), torch.distributed rendezvous.
EXPOSE 50051 29500
ENTRYPOINT ["gearshift"]
CMD ["worker", "--config", "/etc/gearshift/engine.json"]
