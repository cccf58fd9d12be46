#!/usr/bin/env bash
# Install the system packages raytool's tests need beyond Python (Debian/Ubuntu, apt):
#   openssh-server, openssh-client  the `ray up` walk (tests/integration/test_ray_up.py) starts its own sshd
#   rsync, netcat-openbsd           `ray up` syncs files with rsync; the walk reaches sshd through `nc`
#   chromium                        the headless-browser test of the dashboard pages
#   libtcmalloc-minimal4            tcmalloc, which the vLLM CPU engine preloads (rollout.cpu_preload): +18% decode
# Idempotent and quiet: packages already installed are skipped, and apt is not touched at all when
# nothing is missing. Runs as root, or through sudo when that is available.
# No service is started: a policy-rc.d (only while this runs, only if none exists) keeps the
# openssh-server package from starting a system sshd on port 22.
set -euo pipefail

PACKAGES=(openssh-server openssh-client rsync netcat-openbsd chromium libtcmalloc-minimal4)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]; then
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "system_deps: all installed (${PACKAGES[*]})"
  exit 0
fi

if ! command -v apt-get >/dev/null; then
  echo "system_deps: apt-get not found; install these yourself: ${missing[*]}" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "system_deps: not root and no password-less sudo; as root run: apt-get install ${missing[*]}" >&2
  exit 1
fi

policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
  "${SUDO[@]}" chmod 755 "$policy"
  trap '"${SUDO[@]}" rm -f "$policy"' EXIT
fi

echo "system_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
echo "system_deps: done"
