# syntax=docker/dockerfile:1
# The one image disagg runs in a cluster (ghcr.io/disagg/disagg:<version>; the chart's image.operator):
#   the operator                 disagg operator [...]           charts/disagg-operator, manifests/install
#   the router                   disagg router [...]             a Deployment per DisaggregatedInference
#   the rendezvous               disagg rendezvous [...]         a Deployment per DisaggregatedInference
#   the plugin init container    disagg install-plugin <dir>     copies the vLLM connector plugin into engine pods
# The operator passes this image to its children with --operator-image. vLLM is not in it: engines run the
# vLLM image named in each DisaggregatedInference (spec.engine.image).
#
#   docker build -t ghcr.io/disagg/disagg:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Build the wheels of disagg and its runtime dependencies only (no test extras, no vLLM).
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY operator/ operator/
COPY connector/ connector/
COPY devcluster/ devcluster/
COPY compare/ compare/
RUN pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels disagg
# Non-root, matching the chart's securityContext (runAsUser 65532); the root filesystem can be read-only.
USER 65532:65532
ENTRYPOINT ["disagg"]
CMD ["--help"]
