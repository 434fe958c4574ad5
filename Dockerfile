# flashnext on CUDA: the project on PyTorch's CUDA image; `--tp 2` starts both ranks inside the container.
#   docker build -t flashnext .
#   docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models flashnext /models/Qwen3.8-Flash-Next-NVFP4 --tp 2
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1

WORKDIR /opt/flashnext
COPY pyproject.toml README.md ./
COPY model model
COPY kernels kernels
COPY rankwire rankwire
COPY server server
RUN pip install --no-cache-dir ".[cuda12]"

EXPOSE 8000
ENTRYPOINT ["flashnext", "serve", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda"]
CMD []
