# flashnext on CUDA: the project on PyTorch's CUDA image; `--tp 2` starts both ranks inside the container.
#   docker build -t flashnext .
#   docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models flashnext /models/Qwen3.8-Flash-Next-NVFP4 --tp 2
# torch 2.11 with its Triton 3.6 is the pair the GPU checks in docs/gpu.md ran on.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# NVLink multicast off (NCCL, symmetric memory, NVSHMEM): on shared H200 hosts it can put the GPUs out of service.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1

# Triton builds each kernel's launcher with the system's C compiler when the kernel first runs; PyTorch's runtime
# images have not always carried one (pytorch/pytorch#116696), and without it the first round fails.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/flashnext

# torch, Triton and the NVIDIA libraries (NCCL among them) come from the image: pinning them to the image's versions
# makes pip fail rather than replace them, and the project itself goes in with --no-deps.
RUN pip list --format=freeze | grep -iE '^(torch|triton|nvidia-[a-z0-9-]+)==' > /opt/image-torch.txt \
    && pip install -c /opt/image-torch.txt \
        "safetensors>=0.4" \
        "transformers>=5.16.1,<5.25" \
        "tokenizers>=0.21" \
        "jinja2>=3.1.6" \
        "fastapi>=0.110" \
        "uvicorn>=0.29" \
        "pydantic>=2.6" \
        "tqdm>=4.60" \
        "prometheus-client>=0.20"

# Built from a scratch copy that is removed, so `python -m server` (how `--tp 2` starts its ranks) imports the installed
# package; the working directory keeps configs/ for `--load-format dummy` runs of the real shapes.
COPY pyproject.toml README.md /tmp/flashnext/
COPY model /tmp/flashnext/model
COPY kernels /tmp/flashnext/kernels
COPY rankwire /tmp/flashnext/rankwire
COPY server /tmp/flashnext/server
RUN pip install --no-deps /tmp/flashnext \
    && rm -rf /tmp/flashnext \
    && pip list --format=freeze | grep -iE '^(torch|triton|nvidia-[a-z0-9-]+)==' | diff /opt/image-torch.txt - \
    && flashnext serve --help > /dev/null
COPY configs configs

RUN useradd --create-home --shell /usr/sbin/nologin flashnext
USER flashnext

EXPOSE 8000
# No model argument serves the small model installed with the package (model/checkpoints/flashnext-small).
ENTRYPOINT ["flashnext", "serve", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]
CMD []
