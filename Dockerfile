# kubesgl: the engine, the router and the operator in one image (`kubesgl serve|router|operator`).
# CUDA 13 with its compiler: FlashInfer compiles the attention kernels a model needs the
# first time it runs them (cached under ~/.cache/flashinfer; mount a volume there to keep them).
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kubesgl \
    PATH=/opt/kubesgl/bin:$PATH

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/kubesgl

# torch first, from the CUDA 13 index, so that the project's `torch>=2.4` takes it as it is.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cu130 torch==2.11.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubesgl kubesgl
COPY engine engine
COPY router router
COPY operator operator
# the project itself, from this folder (the flashinfer extra pins the release that was measured)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[flashinfer,disagg]" \
    && useradd --uid 1000 --create-home kubesgl

USER 1000
WORKDIR /home/kubesgl
ENTRYPOINT ["kubesgl"]
CMD ["--help"]
