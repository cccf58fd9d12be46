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
# Versions: scripts/versions.env. Base: vllm/vllm-openai:v$GPU_VLLM_VERSION, vLLM's CUDA 13 build
# (NVIDIA driver 580 or newer); on CUDA 12 drivers build with --build-arg CUDA_TAG_SUFFIX=-cu129,
# the CUDA 12.9 build of the same release. That tag scheme (vX.Y.Z, vX.Y.Z-cu129) is the one
# vLLM's release pipeline publishes (.buildkite/scripts/publish-release-images.sh); the pinned tag
# itself was not looked up on Docker Hub when it was pinned (no registry access). The build stops
# unless the base ships the vLLM and torch of scripts/versions.env; they stay exactly as the base
# ships them (the install below is constrained to the base's torch, vLLM and transformers).
# Ray: every node of a cluster and the machine that runs `ray up` / `ray job submit` should run the
# same Ray version: RAY_VERSION pins it (build with --build-arg RAY_VERSION=... to match yours).
ARG GPU_VLLM_VERSION=0.32.0
ARG CUDA_TAG_SUFFIX=
FROM vllm/vllm-openai:v${GPU_VLLM_VERSION}${CUDA_TAG_SUFFIX}

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
COPY scripts/versions.env ./scripts/
COPY raytool ./raytool
COPY actors ./actors
COPY examples ./examples
COPY cluster_configs ./cluster_configs

# The base's vLLM and torch checked against scripts/versions.env; then raytool and its dependencies
# into the image's Python, without replacing the CUDA builds of torch, vLLM and the libraries they
# were built against. Extras: e2b (E2B / AGS sandboxes), gpu (Liger-Kernel), qlora (bitsandbytes).
RUN (set -a && . scripts/versions.env && python3 -c "import os; from importlib.metadata import version; \
have = {p: version(p).split('+')[0] for p in ('vllm', 'torch')}; \
want = {'vllm': os.environ['GPU_VLLM_VERSION'], 'torch': os.environ['GPU_TORCH_VERSION']}; \
assert have == want, f'base image has {have}, scripts/versions.env pins {want}: change the FROM tag and the pins together'") \
 && python3 -m pip freeze | grep -iE '^(torch|torchvision|torchaudio|vllm|transformers|triton|xformers|flashinfer[-_a-z]*)==' > /tmp/base-pins.txt \
 && python3 -m pip install -c /tmp/base-pins.txt ".[e2b,gpu,qlora]" "ray[default]==${RAY_VERSION}" \
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
