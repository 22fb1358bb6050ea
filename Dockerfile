# syntax=docker/dockerfile:1.7
#
# cryptd container image.
#
# Stage "build" turns the project and every runtime dependency into wheels (versions pinned by
# docker/constraints.txt, binary wheels only: no compiler enters either stage), the
# "postgresql" extra included (psycopg with its bundled libpq: the key store that
# k8s/postgresql selects with CRYPTD_KEYSTORE_URL; docker/update_constraints.py pins the same
# extras, IMAGE_EXTRAS). Stage "runtime" installs those wheels offline into the same pinned
# base, removes pip, and runs as a non-root numeric user. The runtime needs no writable path
# outside the volumes the deployment mounts: /tmp and PROMETHEUS_MULTIPROC_DIR (see
# docs/DEPLOY.md for `docker run --read-only`).
#
# Base: python:3.11.16-slim-bookworm, pinned by tag (readable) and by the digest of its
# multi-architecture index (immutable). Debian bookworm's libssl3 (OpenSSL 3.0) has SM2, which
# cryptd binds through cffi; docker/check_libcrypto.py fails the build if that ever changes.
# The base is a build argument: without a registry, build on one made from Debian's packages
# (docker/debian-base.sh; docs/DEPLOY.md section 1.1 lists how it differs), as CI does.
ARG PYTHON_IMAGE=python:3.11.16-slim-bookworm@sha256:528257d48c1da0dcecc2e725d1ae34498d60c965f1241e39cd6a85a8859bdf84

FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
COPY docker/constraints.txt docker/constraints.txt
COPY pyproject.toml README.md ./
COPY service/ service/
# The light client the server's CLI signs with (pyproject.toml: packages found in client/ too).
COPY client/cryptd_client/ client/cryptd_client/
# The only step that downloads. pip's download cache is a cache mount: kept by the builder
# between builds, never in a layer. A builder whose HTTPS goes through a TLS-inspecting proxy
# passes its CA bundle as the build secret "ca-certificates" (docker build --secret
# id=ca-certificates,src=FILE); it covers the image's own bundle for this step only and enters
# no layer either. Without the secret the image's bundle is used.
RUN --mount=type=cache,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt,required=false \
    python -m pip wheel --wheel-dir /wheels --only-binary=:all: \
        --constraint docker/constraints.txt '.[postgresql]' \
    && ls /wheels/cryptd-*.whl


FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="cryptd" \
      org.opencontainers.image.description="Encryption service: AES-GCM, SM4, RSA, ECDSA, Ed25519 and SM2 behind one signed REST API" \
      org.opencontainers.image.licenses="Apache-2.0"

# One fixed numeric identity, matching runAsUser/runAsGroup in k8s/base/deployment.yaml.
RUN groupadd --system --gid 10001 cryptd \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin cryptd

# Offline install from the build stage's wheels: the project's wheel with its "postgresql"
# extra, every dependency from the same directory. pip compiles the .pyc files here, at build
# time, so nothing needs writing at run time; then pip, setuptools and wheel leave the image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir --no-index --root-user-action=ignore \
        --find-links=/wheels "$(ls /wheels/cryptd-*.whl)[postgresql]" \
    && python -m pip uninstall --yes --root-user-action=ignore pip setuptools wheel

COPY --chmod=0555 docker/entrypoint.sh /usr/local/bin/cryptd-entrypoint
COPY --chmod=0444 docker/healthcheck.py docker/check_libcrypto.py /usr/local/lib/cryptd/

# SM2 in the base's libcrypto; psycopg's own libpq (the binary wheel's, not the base's) loads.
RUN python /usr/local/lib/cryptd/check_libcrypto.py \
    && python -c "import psycopg; assert psycopg.pq.__impl__ == 'binary', psycopg.pq.__impl__" \
    && cryptd --help > /dev/null \
    && install --directory --owner=10001 --group=10001 --mode=0750 /run/cryptd/metrics

# Production defaults; the paths match the Secret mounts in k8s/base/deployment.yaml.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    TMPDIR=/tmp \
    CRYPTD_ENV=production \
    CRYPTD_HOST=0.0.0.0 \
    CRYPTD_PORT=8080 \
    CRYPTD_MASTER_KEY_FILE=/etc/cryptd/master-key/master.key \
    CRYPTD_KEYRING_FILE=/etc/cryptd/keyring/keyring.json \
    CRYPTD_KEYRING_READ_ONLY=true \
    CRYPTD_CLIENTS_FILE=/etc/cryptd/clients/clients.json \
    PROMETHEUS_MULTIPROC_DIR=/run/cryptd/metrics

USER 10001:10001
EXPOSE 8080

# uvicorn drains in-flight requests on SIGTERM; the entrypoint execs the server so it gets it.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "/usr/local/lib/cryptd/healthcheck.py"]

ENTRYPOINT ["/usr/local/bin/cryptd-entrypoint"]
CMD []
