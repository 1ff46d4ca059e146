# moco-retrieval: photos -> MoCo -> FAISS index -> search UI, in a container.
#
#   GPU (default):  docker build -t moco-retrieval .
#                   docker run --gpus all -v ~/Pictures:/photos:ro -v moco-work:/work -p 7860:7860 \
#                       --env-file moco.env moco-retrieval   (moco.env: MOCO_AUTH=alice:long-secret, chmod 600)
#   Compose:        PHOTOS=~/Pictures docker compose up -d   (compose.yaml: the same, the login from moco.env)
#   CPU:            docker build --build-arg VARIANT=cpu [--build-arg TORCH_INDEX=URL] -t moco-retrieval:cpu .
#                   docker run -v ~/Pictures:/photos:ro -v moco-work:/work -p 7860:7860 moco-retrieval:cpu
#                   (TORCH_INDEX: PyTorch's CPU wheel index, for torch's CPU build: about 4.5 GB less; see the README)
#
# The container runs `moco run /photos --work /work` (train, export, index, serve on 0.0.0.0:7860);
# re-running it with the same /work volume resumes and updates instead of starting over. Pass
# a pretrained model with `-v ./ckpt:/ckpt:ro` and `moco run /photos --work /work --checkpoint /ckpt/FILE`.
ARG VARIANT=gpu
ARG TORCH_INDEX=
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG CPU_IMAGE=python:3.11-slim-bookworm

FROM ${CUDA_IMAGE} AS base-gpu
# the distribution's python3 of the pinned base image (apt pins would break on every point release)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

FROM ${CPU_IMAGE} AS base-cpu

# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG VARIANT
ARG TORCH_INDEX
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# torch pinned (hadolint does not read the pins after the optional --index-url)
# hadolint ignore=DL3013
RUN python3 -m venv /opt/venv \
    && pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} torch==2.14.1 torchvision==0.29.1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY moco ./moco
COPY index ./index
COPY app ./app
# the page (ui), curves.png (plot), iPhone and camera photos (heic, raw: the non-root user cannot add them later) and
# one FAISS: faiss-gpu with its CUDA 12 libraries (gpu), or faiss-cpu (index); this project itself, whose
# dependencies pyproject.toml bounds
# hadolint ignore=DL3013
RUN if [ "$VARIANT" = gpu ]; then pip install "./[gpu,ui,plot,heic,raw]"; \
    else pip install "./[index,ui,plot,heic,raw]"; fi \
    && useradd --create-home --uid 1000 moco \
    && mkdir -p /work /photos && chown moco /work
USER 1000
VOLUME ["/work"]
EXPOSE 7860
# alive while the server answers on its port (a 401 of the login counts: it answered); `moco run` serves the page
# from its first minute, before training ends
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 CMD ["python3", "-c", \
    "import sys, urllib.request as r, urllib.error as e\ntry: r.urlopen('http://127.0.0.1:7860/', timeout=8)\nexcept e.HTTPError: pass\nexcept OSError: sys.exit(1)"]
ENTRYPOINT ["moco"]
CMD ["run", "/photos", "--work", "/work", "--host", "0.0.0.0", "--port", "7860"]
