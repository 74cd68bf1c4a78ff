# PGVI project image: a Flower 1.39 SuperExec with the PGVI app and its dependencies
# pre-installed. One image serves both roles of docker-compose.yml:
#   superexec-serverapp   flower-superexec --runtime-api-address superlink:8000 ...    (runs ServerApps)
#   superexec-clientapp-k flower-superexec --runtime-api-address supernode-k:9094 ... (runs ClientApps)
#   compute-worker-k      python -m client.warm_worker --socket /app/worker/worker.sock (entrypoint
#                         overridden in docker-compose.yml; node k's warm compute worker)
#
# Base tag: the plain `flwr/superexec:1.39.0` tag is the Python 3.13 Ubuntu variant, but
# pyproject.toml pins requires-python ">=3.11,<3.12", so the Python 3.11 Ubuntu 24.04
# variant of the same 1.39.0 release is the default here.
#
# torch: installed first from the CPU-only wheel index (no CUDA libraries, ~5x smaller);
# on arm64 hosts the same index serves aarch64 CPU wheels. Override with
#   --build-arg TORCH_INDEX_URL=... --build-arg TORCH_PACKAGES="torch==2.9.1"
# Runtime dependency installation stays OFF (images are pre-baked; see docs/deploy.md).
#
# C compiler: gcc and the C library's headers, so that the core builds its fused kernels for the CPU the
# container runs on at first use (README, "Compiled kernels": local updates 2.3-2.6x faster than torch alone)
# into /app/kernels. --build-arg KERNEL_COMPILER= leaves it out (the kernels then fall back to torch, with one
# warning). Installed as root, then back to Flower's non-root user `app` (uid 49999), as Flower's Docker
# documentation does for system packages.
#
# No certificate or key is ever copied into the image (.dockerignore excludes certs/);
# they are mounted read-only at run time.

ARG FLWR_SUPEREXEC_IMAGE=flwr/superexec:1.39.0-py3.11-ubuntu24.04
FROM ${FLWR_SUPEREXEC_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_PACKAGES="torch"
# scikit-learn: the default data set (digits) ships inside it; add torchvision here for
# the MNIST-family loaders (--build-arg EXTRA_PACKAGES="scikit-learn>=1.4 torchvision").
ARG EXTRA_PACKAGES="scikit-learn>=1.4"
ARG KERNEL_COMPILER="gcc libc6-dev"

ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PGVI_KERNEL_CACHE=/app/kernels

WORKDIR /app

# 0. the kernels' C compiler (root only for apt-get)
USER root
# hadolint ignore=DL3008
RUN if [ -n "${KERNEL_COMPILER}" ]; then \
      apt-get update && apt-get install -y --no-install-recommends ${KERNEL_COMPILER} \
      && rm -rf /var/lib/apt/lists/*; \
    fi
USER app

# 1. CPU torch (cached layer, independent of the project sources)
# hadolint ignore=DL3013
RUN python -m pip install --index-url "${TORCH_INDEX_URL}" ${TORCH_PACKAGES}

# 2. the project (client-only dependencies: no flwr[simulation]/ray); flwr 1.39.0 from the
#    base image already satisfies "flwr>=1.39,<1.40", so pip leaves it alone.
COPY --chown=app:app pyproject.toml ./
COPY --chown=app:app common ./common
COPY --chown=app:app strategies ./strategies
COPY --chown=app:app client ./client
COPY --chown=app:app server ./server
# hadolint ignore=DL3013
RUN python -m pip install . ${EXTRA_PACKAGES} \
    && python -c "import flwr, torch, common, client, server; assert flwr.__version__ == '1.39.0', flwr.__version__" \
    && mkdir -p /app/state /app/outputs /app/worker /app/kernels \
    && chmod 700 /app/worker /app/kernels

# /app/worker is 0700: the compute worker refuses a socket directory that others can enter; so is /app/kernels:
# the core loads compiled kernels only from a directory of its own user that nobody else can write.
# Named volumes mounted on /app/state, /app/outputs and /app/worker (docker-compose.yml) are initialised
# from these directories and so inherit their `app` (uid 49999) ownership.

ENTRYPOINT ["flower-superexec"]
