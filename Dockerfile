# raytool on a CPU node: the same environment scripts/setup.sh builds, at /opt/raytool/.venv.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ util-linux && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/raytool
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY raytool ./raytool
COPY actors ./actors
COPY examples ./examples
COPY cluster_configs ./cluster_configs
RUN ./scripts/setup.sh && .venv/bin/python -c "from raytool.models import resolve_model; resolve_model('smollm2-135m-instruct')"
ENV PATH=/opt/raytool/.venv/bin:$PATH HF_HUB_OFFLINE=1
# The local sandbox isolates cells with namespaces; Docker's default seccomp profile refuses them
# (the sandbox then says so once and runs with rlimits only). For full isolation run with
# `--cap-add SYS_ADMIN --security-opt seccomp=unconfined`, or serve sandboxes from a node that
# allows namespaces: `raytool sandbox serve --host 0.0.0.0 --port 8080`.
CMD ["raytool", "train"]
