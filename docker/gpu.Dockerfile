# raytool for NVIDIA GPU nodes: vLLM's CUDA image with raytool and a pinned Ray on top, run as the
# non-root user `raytool`. The image the cluster YAMLs name (cluster_configs/gpu_nodes.yaml, aws.yaml).
#
#   docker build -f docker/gpu.Dockerfile -t raytool:gpu .        # from the repository root
#
# Entrypoint: none. The vLLM base image starts its OpenAI server; this image clears that, so that
# `ray up` can start the container with `docker run ... raytool:gpu bash` and run `ray start` in it,
# and so that a command given to `docker run` is simply run:
#
#   docker run --rm -it --gpus all --shm-size=16g --net=host raytool:gpu \
#       raytool train -c examples/gsm8k_lora_qwen2.5_1.5b.yaml
#
# Base: vllm/vllm-openai:v0.31.0 (CUDA 13 build: NVIDIA driver 580 or newer). On CUDA 12 drivers use
# the v0.31.0-cu129 tag of the same release. torch, vLLM and transformers stay exactly as the base
# image ships them (the install below is constrained to those versions).
# Ray: every node of a cluster and the machine that runs `ray up` / `ray job submit` should run the
# same Ray version: RAY_VERSION pins it (build with --build-arg RAY_VERSION=... to match yours).
FROM vllm/vllm-openai:v0.31.0

ARG RAY_VERSION=2.60.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

# rsync: Ray copies files into its containers with `rsync -e 'docker exec -i'`; openssh-client: the
# head's autoscaler reaches worker nodes over SSH from inside the container; util-linux: `unshare`
# for the local sandbox's namespaces.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends rsync openssh-client util-linux \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/raytool
COPY pyproject.toml README.md ./
COPY raytool ./raytool
COPY actors ./actors
COPY examples ./examples
COPY cluster_configs ./cluster_configs

# raytool and its dependencies into the image's Python, without replacing the CUDA builds of torch,
# vLLM and the libraries they were built against.
RUN python3 -m pip freeze | grep -iE '^(torch|torchvision|torchaudio|vllm|transformers|triton|xformers|flashinfer[-_a-z]*)==' > /tmp/base-pins.txt \
 && python3 -m pip install -c /tmp/base-pins.txt ".[qlora,gpu]" "ray[default]==${RAY_VERSION}" \
 && python3 -c "import raytool, actors, ray, vllm, torch; print('raytool image:', 'ray', ray.__version__, 'vllm', vllm.__version__, 'torch', torch.__version__)" \
 && rm /tmp/base-pins.txt

# The non-root user. `ray up` reads HOME from the image to place its files (~/ray_bootstrap_*,
# ~/.ray/auth_token), so HOME is set explicitly. `ray` and `raytool` are in /usr/local/bin, on the
# PATH of the login shells Ray runs its commands in.
RUN useradd --create-home --shell /bin/bash raytool \
 && mkdir -p /opt/raytool/runs && chown raytool /opt/raytool/runs
ENV HOME=/home/raytool
USER raytool
WORKDIR /home/raytool

ENTRYPOINT []
CMD ["bash"]
