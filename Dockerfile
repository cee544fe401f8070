# syntax=docker/dockerfile:1
# kvxferd container image.
#   docker build -t kvxferd:dev .
#   GPU nodes: a CUDA build of torch, e.g.
#   docker build --build-arg TORCH_INDEX_URL=<your CUDA torch wheel index> -t kvxferd:dev .
# Same install order as the README: `pip install torch==2.13.0` first, then `pip install .`.

ARG PYTHON_VERSION=3.11

# ---- build: a self-contained virtualenv in /opt/kvxferd ------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VERSION=2.13.0
# Empty: torch from the default index. Set it to pick a CUDA (or CPU-only) torch build.
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvxferd
ENV PATH=/opt/kvxferd/bin:$PATH
# torch first, in its own layer: it is by far the largest and changes least often.
RUN if [ -n "$TORCH_INDEX_URL" ]; then export PIP_INDEX_URL="$TORCH_INDEX_URL"; fi \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir . \
 && kvxferd --version

# ---- runtime -------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm
# RDMA user-space providers (libibverbs + NIC drivers) and numactl's library for UCX.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ibverbs-providers libibverbs1 librdmacm1 libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvxferd \
 && useradd --system --uid 10001 --gid kvxferd --home-dir /var/lib/kvxferd --create-home \
      --shell /usr/sbin/nologin kvxferd \
 && install -d -o kvxferd -g kvxferd -m 0750 /run/kvxferd \
 && install -d -m 0755 /etc/kvxferd
COPY --from=build /opt/kvxferd /opt/kvxferd
ENV PATH=/opt/kvxferd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVXFERD_SOCKET=/run/kvxferd/kvxferd.sock \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/lib/kvxferd
# 7471: kvxfer.v1.Peer (daemon <-> daemon); 9479: Prometheus /metrics.
EXPOSE 7471 7472 9479
# Asks the running daemon over its Unix socket (KVXFERD_SOCKET).
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["kvxferd", "status"]
# SIGTERM drains (drain_grace_s, 20 s by default): `docker stop -t 45`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvxferd"]
CMD ["serve"]
