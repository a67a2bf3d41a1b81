# The image the Helm chart runs (deploy/helm/hybridpd/values.yaml `image`): the proxy and every Ray pod.
#   docker build -t hybridpd:0.1.0 .
# Base: a CUDA image of the Ray version the chart's RayCluster declares (values.yaml rayVersion). hybridpd is
# installed by scripts/setup.sh itself, into the image's Python (the one Ray starts workers with), with the gpu
# extra (fla-core fast-path kernels): what `bash scripts/setup.sh gpu` installs, nothing else
# (tests/unit/test_dockerfile.py checks both).
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-cu128
FROM ${BASE_IMAGE}

WORKDIR /home/ray/hybridpd
COPY --chown=ray:users . /home/ray/hybridpd
RUN HYBRIDPD_PYTHON=python bash scripts/setup.sh gpu && python -m pip cache purge >/dev/null 2>&1 || true

EXPOSE 8000
CMD ["hybridpd", "serve", "--host", "0.0.0.0"]
