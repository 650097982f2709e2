# syntax=docker/dockerfile:1.7
# Gearshift operator/router image: the kopf operator (`python -m gearshift.operator.reconcile`) and
# each InferenceDeployment's router (`gearshift router --config /etc/gearshift/router.json`).
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/gearshift/operator:0.1.0 .
#
# No GPU here: torch (a dependency of the package) comes from the CPU index to keep the image small.
# Runs as the non-root user 65532 with a read-only root filesystem (the chart and the operator set
# both); /tmp is an emptyDir.

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gearshift
ENV PATH=/opt/gearshift/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY operator ./operator
COPY proto ./proto
RUN pip install ".[operator]" && pip check

FROM python:${PYTHON_VERSION}-slim-bookworm
COPY --from=build /opt/gearshift /opt/gearshift
ENV PATH=/opt/gearshift/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf
RUN groupadd --gid 65532 gearshift && useradd --uid 65532 --gid 65532 --no-create-home gearshift
USER 65532:65532
# Router: OpenAI HTTP, gRPC Generation, Admin; operator: liveness.
EXPOSE 8000 50050 50060 8080
CMD ["python", "-m", "gearshift.operator.reconcile", "--all-namespaces"]
