# raytool on a CPU node: the same environment scripts/setup.sh builds, at /opt/raytool/.venv, run
# as the non-root user `raytool`. GPU and Ascend NPU images: docker/gpu.Dockerfile, docker/ascend.Dockerfile.
#
#   docker build -t raytool:cpu .
#   docker run --rm -it raytool:cpu                      # the embedded tiny run: `raytool train`
FROM python:3.11-slim
# libtcmalloc-minimal4: vLLM's CPU engine runs with it preloaded (rollout.cpu_preload), +18% decode.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ util-linux libtcmalloc-minimal4 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/raytool
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY raytool ./raytool
COPY actors ./actors
COPY examples ./examples
COPY cluster_configs ./cluster_configs
# The converted SmolLM2 checkpoint is cached in the image, where the non-root user can read it.
ENV RAYTOOL_CACHE=/opt/raytool/cache
RUN ./scripts/setup.sh && .venv/bin/python -c "from raytool.models import resolve_model; resolve_model('smollm2-135m-instruct')"
ENV PATH=/opt/raytool/.venv/bin:$PATH HF_HUB_OFFLINE=1
# Debian's /etc/profile resets PATH for login shells (Ray runs its commands in `bash --login`):
# put the environment back on it there too.
RUN echo 'export PATH="/opt/raytool/.venv/bin:$PATH"' > /etc/profile.d/raytool.sh \
 && useradd --create-home --shell /bin/bash raytool \
 && mkdir -p runs && chown -R raytool runs "$RAYTOOL_CACHE"
ENV HOME=/home/raytool
USER raytool
# The local sandbox isolates cells with namespaces; Docker's default seccomp profile refuses them
# (the sandbox then says so once and runs with rlimits only). For full isolation run with
# `--cap-add SYS_ADMIN --security-opt seccomp=unconfined`, or serve sandboxes from a node that
# allows namespaces: `raytool sandbox serve --host 0.0.0.0 --port 8080`.
CMD ["raytool", "train"]
