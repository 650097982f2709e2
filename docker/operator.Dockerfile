# syntax=docker/dockerfile:1.7
# Gearshift operator/router image: the kopf operator (`python -m gearshift.operator.reconcile`) and
# each InferenceDeployment's router (`gearshift router --config /etc/gearshift/router.json`).
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/gearshift/operator:0.1.0 .
#
# No torch here: the operator, the router and the simulator never import it (the engine is the
# package's `worker` extra; tests/operator/test_no_torch.py runs them where torch cannot import).
# Runs as the non-root user 65532 with a read-only root filesystem (the chart and the operator set
# both); /tmp is an emptyDir.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gearshift
ENV PATH=/opt/gearshift/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY operator ./operator
COPY proto ./proto
RUN pip install ".[operator]" && pip check
# The image must stay torch-free, and what it runs must import without it.
RUN ! python -c "import torch" 2>/dev/null \
    && python -c "import gearshift.operator.reconcile.reconciler, gearshift.operator.router.server, gearshift.operator.cli"

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
