# syntax=docker/dockerfile:1
# The bundled worker (`mesh worker`: one model behind an OpenAI-compatible API) on an NVIDIA GPU.
#
# Base image: nvidia/cuda:12.6.3-runtime-ubuntu24.04 (NVIDIA's CUDA 12.6 runtime on Ubuntu 24.04,
# whose Python is 3.12). torch comes from PyTorch's cu126 wheel index (its CUDA libraries are in
# the wheels; the host needs an NVIDIA driver >= 560 and the NVIDIA container toolkit, which
# mounts libcuda). gcc and the Python headers are there for Triton, which compiles its launcher
# at the first kernel launch. Build another CUDA with --build-arg CUDA_IMAGE=... TORCH_INDEX=...
# (any CUDA build of torch >= 2.4 with Triton works; see pyproject's `engine` extra).
#
#   docker build -f deploy/docker/worker.Dockerfile -t mesh-worker:0.1.0 .
#   docker run --rm --gpus all -p 8001:8000 -p 5557:5557 mesh-worker:0.1.0 \
#       --host 0.0.0.0 --port 8000 --preset llama3-1b --kv-events-endpoint 'tcp://*:5557'
#
# A real model: mount its Hugging Face directory and pass --model /models/NAME.

ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/mesh/bin:$PATH HOME=/tmp
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/mesh && pip install --no-cache-dir --index-url ${TORCH_INDEX} "torch>=2.4"
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY mesh ./mesh
COPY policies ./policies
COPY simulator ./simulator
COPY workers ./workers
RUN pip install --no-cache-dir ".[engine]" && rm -rf /src
WORKDIR /
RUN useradd --system --uid 10001 --gid 0 --no-create-home --shell /usr/sbin/nologin mesh
USER 10001
# 8000: the OpenAI-compatible API; 5557: the KV event publisher (ZMQ PUB, --kv-events-endpoint).
EXPOSE 8000 5557
# Loading a model takes minutes: a long start period.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["mesh", "worker"]
# Listen on the pod's interfaces; tcp://*:PORT binds the KV events on them too (vLLM's rule: a
# wildcard endpoint is bound, a concrete one connected to).
CMD ["--host", "0.0.0.0", "--port", "8000", "--kv-events-endpoint", "tcp://*:5557"]
