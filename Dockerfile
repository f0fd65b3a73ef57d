# legato on a GPU: the CUDA runtime, the project installed from these files with the README's set-up command,
# `legato serve` as the entry point and a health check on /health. docs/deploy.md has the runs (with a GPU,
# without one, with the deploy files and Ray).
#   docker build -t legato .
#   docker build -t legato:ray --build-arg EXTRAS=ray,mooncake,hub .     # the image the KubeRay manifests name
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG EXTRAS=""
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    LEGATO_CACHE=/cache/legato HF_HOME=/cache/huggingface

# Ubuntu's Python is externally managed (PEP 668), so the project lives in a virtual environment.
# libibverbs1: the mooncake extra's transfer engine links it even over TCP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libibverbs1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/legato
COPY pyproject.toml README.md ./
COPY legato ./legato
# The README's set-up command: torch pinned (PyPI's Linux wheel is the CUDA build), legato from these files.
RUN pip install torch==2.13.0 -e .
RUN if [ -n "$EXTRAS" ]; then pip install -e ".[$EXTRAS]"; fi
COPY deploy ./deploy

EXPOSE 8000
# A real checkpoint loads for minutes; failures count only after the start period. /health is 503 once the
# engine has died or the server drains (SIGTERM), and the probe fails on any answer but 200.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Inside the container the server listens on every address (the port is what `docker run -p` publishes);
# arguments after the image name are legato serve's: a model, --api-key, --deploy deploy/1p1d.yaml, ...
ENTRYPOINT ["legato", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
