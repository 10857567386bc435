# The sandkeep image: the `sandkeep` console script (controller, agent, doctor, ...), installed from the
# lock (constraints.txt) into a virtualenv, on a slim Python base. Runs as a non-root uid by default;
# the chart's agent DaemonSet alone overrides that (uid 0 with four capabilities, see
# charts/sandkeep/templates/agent-daemonset.yaml).
#
#   hack/rmtree.sh build/sandkeep-rmtree && docker build -t sandkeep:dev .
#   make image     # the same file with buildah, with no Docker engine and no registry (docs/image.md)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY constraints.txt pyproject.toml README.md* ./
COPY controller ./controller
# Every dependency at the version of the lock; `pip check` and `--version` fail the build on a broken install.
RUN python -m venv /opt/sandkeep \
 && /opt/sandkeep/bin/pip install --constraint constraints.txt . \
 && /opt/sandkeep/bin/pip check \
 && /opt/sandkeep/bin/sandkeep --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="sandkeep" \
      org.opencontainers.image.description="Keep finished jobs' workspaces on each node's disk for a retention window" \
      org.opencontainers.image.licenses="Apache-2.0"
# The uid the pods run the controller as needs a name: kopf names its identity after getpass.getuser(),
# which raises KeyError for a uid /etc/passwd does not know, and the controller stopped as it started.
# (--no-log-init: no sparse lastlog/faillog entry at offset 65532 blown up in the layer.)
RUN groupadd --system --gid 65532 nonroot \
 && useradd --system --no-log-init --uid 65532 --gid 65532 --home-dir /nonexistent --shell /usr/sbin/nologin nonroot
COPY --from=build /opt/sandkeep /opt/sandkeep
# The compiled walker the agent deletes directories with (rmtree/; docs/benchmarks.md), static, built on the host
# before the build: `hack/rmtree.sh build/sandkeep-rmtree` (make image does it).
COPY build/sandkeep-rmtree /opt/sandkeep/bin/sandkeep-rmtree
ENV PATH=/opt/sandkeep/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# 65532: the conventional "nonroot" uid; the pods also set it and forbid root (runAsNonRoot).
USER 65532:65532
ENTRYPOINT ["sandkeep"]
CMD ["--help"]
