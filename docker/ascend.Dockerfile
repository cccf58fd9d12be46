# raytool for Ascend NPU nodes (Atlas A2): the vllm-ascend image (CANN, torch, torch_npu, vLLM,
# vllm-ascend) with raytool and a pinned Ray on top, run as the non-root user `raytool`.
# The image cluster_configs/ascend_npu.yaml names.
#
#   docker build -f docker/ascend.Dockerfile -t raytool:ascend .                 # repository root
#   docker build -f docker/ascend.Dockerfile --build-arg ASCEND_GID=$(getent group HwHiAiUser | cut -d: -f3) -t raytool:ascend .
#
# Entrypoint: the base image's (it loads CANN's environment, then runs the command it is given), so
# `ray up`'s `docker run ... raytool:ascend bash` and `docker run ... raytool:ascend raytool train ...`
# both start with CANN set up. Run by hand (the NPUs and the host's driver go in, as in ascend_npu.yaml):
#
#   docker run --rm -it --net=host --shm-size=16g --device=/dev/davinci0 --device=/dev/davinci_manager \
#       --device=/dev/devmm_svm --device=/dev/hisi_hdc -v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro \
#       -v /usr/local/dcmi:/usr/local/dcmi:ro -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi:ro \
#       -v /etc/ascend_install.info:/etc/ascend_install.info:ro raytool:ascend npu-smi info
#
# Versions: scripts/versions.env. Base: quay.io/ascend/vllm-ascend:v$NPU_VLLM_ASCEND_VERSION (0.23.0:
# CANN 9.1.0, Python 3.12, vLLM built from source for no device). For Atlas A3 build with
# --build-arg ASCEND_TAG_SUFFIX=-a3 (the -a3 tag of the same release). The build stops unless the
# base ships the vllm-ascend, vLLM, torch, torch_npu, triton-ascend and transformers of
# scripts/versions.env, and nothing below may replace them.
# NPU access: the host's /dev/davinci* belong to the driver's HwHiAiUser group; ASCEND_GID must be
# that group's id on your hosts (1000 is the driver installer's usual choice).
ARG NPU_VLLM_ASCEND_VERSION=0.23.0
ARG ASCEND_TAG_SUFFIX=
FROM quay.io/ascend/vllm-ascend:v${NPU_VLLM_ASCEND_VERSION}${ASCEND_TAG_SUFFIX}

ARG RAY_VERSION=2.60.0
ARG ASCEND_GID=1000
ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

SHELL ["/bin/bash", "-c"]

# rsync: Ray copies files into its containers with it; openssh-client: the head's autoscaler SSHes
# to the workers; util-linux: `unshare` for the local sandbox.
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

# The base's versions checked against scripts/versions.env (vLLM's carries +empty: built for no
# device), then held by a constraints file while raytool installs. Extras: e2b (E2B / AGS
# sandboxes); not gpu or qlora (CUDA only: Liger-Kernel's PyPI triton would replace triton-ascend).
RUN (set -a && . scripts/versions.env && python3 -c "import os; from importlib.metadata import version; \
pins = {'vllm-ascend': 'NPU_VLLM_ASCEND_VERSION', 'vllm': 'NPU_VLLM_VERSION', 'torch': 'NPU_TORCH_VERSION', \
'torch-npu': 'NPU_TORCH_NPU_VERSION', 'triton-ascend': 'NPU_TRITON_ASCEND_VERSION', 'transformers': 'NPU_TRANSFORMERS_VERSION'}; \
have = {p: version(p).split('+')[0] for p in pins}; \
want = {p: os.environ[key] for p, key in pins.items()}; \
assert have == want, f'base image has {have}, scripts/versions.env pins {want}: change the FROM tag and the pins together'") \
 && python3 -m pip freeze | grep -iE '^(torch|torch[-_]npu|torchvision|torchaudio|transformers|triton[-_a-z]*|vllm|vllm[-_]ascend)==' > /tmp/pins.txt \
 && python3 -m pip install -c /tmp/pins.txt ".[e2b]" "ray[default]==${RAY_VERSION}" \
 && source /usr/local/Ascend/ascend-toolkit/set_env.sh \
 && python3 -c "import raytool, actors, ray, torch, torch_npu; print('raytool image:', 'ray', ray.__version__, 'torch', torch.__version__, 'torch_npu', torch_npu.__version__)" \
 && rm /tmp/pins.txt

# Login shells (Ray runs every command in `bash --login`): CANN's base image already sources its
# set_env.sh scripts from /etc/profile for every user; add what vllm-ascend gives only root (in
# /root/.bashrc: jemalloc, /usr/local/lib) and keep the image's Python first on PATH.
RUN { echo "export PATH=\"$(dirname "$(command -v python3)"):\$PATH\""; \
      echo 'jemalloc=/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2; [ -f "$jemalloc" ] && export LD_PRELOAD="$jemalloc${LD_PRELOAD:+:$LD_PRELOAD}"'; \
      echo 'export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/lib"'; \
    } > /etc/profile.d/raytool-ascend.sh

# The non-root user, in the group that owns the NPU devices.
RUN group=$(getent group "${ASCEND_GID}" | cut -d: -f1) \
 && if [ -z "$group" ]; then groupadd --gid "${ASCEND_GID}" HwHiAiUser && group=HwHiAiUser; fi \
 && useradd --create-home --shell /bin/bash --groups "$group" raytool \
 && mkdir -p /opt/raytool/runs && chown raytool /opt/raytool/runs
ENV HOME=/home/raytool
USER raytool
WORKDIR /home/raytool
CMD ["bash"]
