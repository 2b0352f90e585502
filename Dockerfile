# syntax=docker/dockerfile:1
# LooseLeaf's image, used by compose.yaml for the store, planner, gpu-hosts and
# frontend: the five binaries, and the worker runtime's Python environment at
# /opt/looseleaf/venv (the gpu-hosts' --python).
#
#   docker build -t looseleaf .                    # CPU torch
#   docker build -t looseleaf --build-arg TORCH=cuda .   # CUDA torch from PyPI
#
# Every RUN step is a script that CI runs (scripts/test runs scripts/setup, which
# runs scripts/build-release; tests/relocatable.rs runs scripts/install-worker-env),
# so what the image does is tested even where no Docker daemon runs (ADR 41).
ARG TORCH=cpu

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN scripts/build-release

FROM python:3.11-slim-bookworm AS runtime
ARG TORCH
WORKDIR /opt/looseleaf
COPY scripts/install-worker-env scripts/requirements.lock scripts/
COPY services/gpu-host/python services/gpu-host/python
RUN scripts/install-worker-env /opt/looseleaf/venv --torch "$TORCH"
COPY --from=build /src/target/release/looseleaf /src/target/release/looseleaf-frontend \
     /src/target/release/looseleaf-gpu-host /src/target/release/looseleaf-planner \
     /src/target/release/looseleaf-store /usr/local/bin/
# the service user's home, the gpu-host's sockets, and the notebooks and package
# layers volumes, writable by it (a named volume takes its folder's owner)
COPY --chown=10001:10001 deploy/empty/ /home/looseleaf/
COPY --chown=10001:10001 deploy/empty/ /run/looseleaf/
COPY --chown=10001:10001 deploy/empty/ /notebooks/
COPY --chown=10001:10001 deploy/empty/ /packages/
ENV LOOSELEAF_PYTHON=/opt/looseleaf/venv/bin/python LOOSELEAF_RUNTIME_DIR=/run/looseleaf HOME=/home/looseleaf
USER 10001:10001
