# syntax=docker/dockerfile:1
# The Mesh gateway: CPU only, no torch (`mesh serve`; the `engine` extra belongs to the worker
# image, deploy/docker/worker.Dockerfile).
#
#   docker build -t mesh-gateway:0.1.0 .
#   docker run --rm -p 8000:8000 mesh-gateway:0.1.0 serve --config /etc/mesh/mesh.yaml \
#       --worker-urls http://10.0.0.5:8000 http://10.0.0.6:8000 --policy kv_aware
#
# /etc/mesh/mesh.yaml is deploy/docker/mesh.yaml (listen on the container's interfaces, port 8000,
# no workers): mount your own over it, or give workers and keys as flags and environment variables
# ($MESH_ADMIN_KEY_FILE, $MESH_API_KEYS_FILE: keys from mounted files).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY mesh ./mesh
COPY policies ./policies
COPY simulator ./simulator
COPY workers ./workers
# Wheels of the project and its dependencies (all have manylinux wheels: no compiler needed).
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
RUN useradd --system --uid 10001 --gid 0 --no-create-home --shell /usr/sbin/nologin mesh
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels pip install --no-cache-dir --no-index --find-links /wheels mesh-router
COPY deploy/docker/mesh.yaml /etc/mesh/mesh.yaml
USER 10001
EXPOSE 8000
# /health answers 200 while the gateway runs (readiness, "some worker can serve", is /ready).
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["mesh"]
CMD ["serve", "--config", "/etc/mesh/mesh.yaml"]
