# syntax=docker/dockerfile:1
# cachelane images, two targets built from one set of wheels (pyproject.toml's extras):
#
#   runtime (the default, last stage): the gateway only, `cachelane[precise,otel]`: either routing
#     mode ([precise]: tokenizers, jinja2, zmq, msgpack) and tracing ([otel]); no simulator, no
#     matplotlib, no Locust.
#       docker build -t cachelane:local .
#       docker run --rm -p 8000:8000 -v $PWD/deploy/compose/gateway-sim.yaml:/etc/cachelane/config.yaml:ro cachelane:local
#   sim: the simulated replicas and the demo, `cachelane[sim]`.
#       docker build --target sim -t cachelane-sim:local .
#       docker run --rm -p 9001:9001 cachelane-sim:local --replicas 2
#
# Checked statically by tests/deploy/test_dockerfile.py (no Docker engine on the dev machines).

ARG PYTHON_IMAGE=python:3.11-slim
# 3.11: pyproject.toml's requires-python floor, the version CI tests on.

# ---- builder: wheels for cachelane and every dependency -------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# Every dependency ships manylinux wheels for CPython 3.11 (amd64 and arm64), so no compiler is
# needed here; if one ever needs compiling, install build-essential in this stage only.
COPY . .
RUN pip wheel --wheel-dir /wheels '.[sim,otel]'

# ---- sim: the simulated replicas (`cachelane sim`), as a non-root user ----------------------
FROM ${PYTHON_IMAGE} AS sim
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
# MPLCONFIGDIR: `cachelane demo` imports matplotlib; without a writable config dir it warns at
# every start.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels 'cachelane[sim]' \
 && groupadd --system --gid 10001 cachelane \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin cachelane
USER 10001:10001
EXPOSE 9001
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9001/health', timeout=2).status != 200)"]
# 9001: `cachelane sim --port`'s default (sim-0's port; loadtest/sim/fleet.py).
ENTRYPOINT ["cachelane", "sim"]
CMD ["--host", "0.0.0.0"]

# ---- runtime: the gateway only (serve), python + the wheels, as a non-root user --------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels 'cachelane[precise,otel]' \
 && groupadd --system --gid 10001 cachelane \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin cachelane \
 && mkdir -p /etc/cachelane
# uid 10001: above the range distributions give to real users, so it maps to no host account;
# the Kubernetes manifests run as the same uid (runAsUser: 10001).
USER 10001:10001
EXPOSE 8000
# 8000: listen.port's default (gateway/config/exposure.py). If your config listens elsewhere,
# change the healthcheck's URL too.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
# interval 10 s / 3 failures: an unhealthy gateway is flagged within ~30 s; start-period 20 s
# covers the imports and the first health check of every replica at start-up.
ENTRYPOINT ["cachelane"]
CMD ["serve", "--config", "/etc/cachelane/config.yaml"]
