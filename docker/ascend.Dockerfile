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
# Base: quay.io/ascend/vllm-ascend:v0.23.0 (vLLM 0.23.0, CANN 9.1.0, Python 3.12, torch 2.10.0,
# torch_npu 2.10.0.post4). For Atlas A3 use the -a3 tag of the same release. The build stops if the
# base's torch_npu is not TORCH_NPU_VERSION, and nothing below may replace torch or torch_npu.
# NPU access: the host's /dev/davinci* belong to the driver's HwHiAiUser group; ASCEND_GID must be
# that group's id on your hosts (1000 is the driver installer's usual choice).
FROM quay.io/ascend/vllm-ascend:v0.23.0

ARG RAY_VERSION=2.60.0
ARG TORCH_VERSION=2.10.0
ARG TORCH_NPU_VERSION=2.10.0.post4
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
COPY raytool ./raytool
COPY actors ./actors
COPY examples ./examples
COPY cluster_configs ./cluster_configs

# torch and torch_npu pinned: checked first, then held by a constraints file while raytool installs.
RUN python3 -c "from importlib.metadata import version; \
have = {p: version(p).split('+')[0] for p in ('torch', 'torch-npu')}; \
want = {'torch': '${TORCH_VERSION}', 'torch-npu': '${TORCH_NPU_VERSION}'}; \
assert have == want, f'base image has {have}, this Dockerfile pins {want}: change the FROM tag and the pins together'" \
 && printf 'torch==%s\ntorch-npu==%s\n' "${TORCH_VERSION}" "${TORCH_NPU_VERSION}" > /tmp/pins.txt \
 && python3 -m pip freeze | grep -iE '^(torchvision|torchaudio|transformers|triton[-_a-z]*)==' >> /tmp/pins.txt \
 && python3 -m pip install -c /tmp/pins.txt . "ray[default]==${RAY_VERSION}" \
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
