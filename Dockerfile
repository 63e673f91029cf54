# kubesgl: the engine, the router and the operator in one image (`kubesgl serve|router|operator`),
# in two variants chosen by the build argument DEVICE:
# - cuda (the default): CUDA 13 with its compiler, for FlashInfer, which compiles the attention
#   kernels a model needs the first time it runs them (cached under ~/.cache/flashinfer; on
#   Kubernetes spec.engine.compileCache keeps them on a claim, docs/operator.md);
# - cpu: Ubuntu and torch's CPU build, a far smaller image for clusters without GPUs
#   (`docker build --build-arg DEVICE=cpu`; the quickstart on kind, docs/up.md).
ARG DEVICE=cuda

FROM nvidia/cuda:13.0.1-devel-ubuntu24.04 AS base-cuda
# the flashinfer extra pins the release that was measured
ENV TORCH_INDEX=https://download.pytorch.org/whl/cu130 KUBESGL_PACKAGE=".[flashinfer]"

FROM ubuntu:24.04 AS base-cpu
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu KUBESGL_PACKAGE="."

# one of the two stages above (hadolint cannot see through the argument)
# hadolint ignore=DL3006
FROM base-${DEVICE}
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

# torch first, from the index of the variant's build, so that the project's `torch>=2.4` takes it as it is.
# 2.11.0 is the CUDA 13 build that the GPU figures of benchmarks/README.md and the flashinfer pin were
# measured with; the README's install (the tests, the quickstart) takes 2.13.0, the CPU build CI runs.
# Move this pin with a GPU run of tests/gpu and the benchmarks, not alone (README.md, Container image).
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.11.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubesgl kubesgl
COPY engine engine
COPY router router
COPY operator operator
# the project itself, from this folder. Ubuntu 24.04 images come with a user ubuntu of uid 1000,
# the uid pods run as: kubesgl takes its place.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "$KUBESGL_PACKAGE" \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --create-home kubesgl

USER 1000
WORKDIR /home/kubesgl
ENTRYPOINT ["kubesgl"]
CMD ["--help"]
