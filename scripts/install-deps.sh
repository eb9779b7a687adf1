#!/usr/bin/env bash
# Install what the lab, the tests and the daemon need on a bare Debian/Ubuntu machine.
# Idempotent: safe to run again. Needs root (apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(iptables nftables ipset conntrack iproute2 curl procps kmod shellcheck
      # The VM lab (tests/vm/vmlab.py): IPVS and systemd are tested in a Debian VM under qemu.
      # debootstrap only recommends the keyring, and recommends are not installed here.
      qemu-system-x86 qemu-utils debootstrap debian-archive-keyring openssh-client e2fsprogs git)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

python3 -m pip install -q -r requirements.txt
# `python3 -m pip` does not run pyenv's rehash hook: make new console scripts (ansible-lint,
# antsibull-changelog, ...) visible where python3 comes from pyenv.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi

# Ansible collections the role and the playbooks use (galaxy.yml `dependencies`,
# requirements.yml). Galaxy is out of reach here, so they come from PyPI: the `ansible`
# package that matches ansible-core 2.19 (ansible 12.x) bundles them; only these three are
# taken out of its wheel (a full `pip install ansible` unpacks ~100 collections) into the
# system-wide collections directory. Skipped when the pinned versions are already there.
COLLECTIONS_DIR=/usr/share/ansible/collections
ANSIBLE_BUNDLE=ansible==12.3.0
declare -A WANT=([community.general]=11.4.2 [ansible.posix]=2.1.0 [kubernetes.core]=6.2.0)
need=0
for c in "${!WANT[@]}"; do
  m="$COLLECTIONS_DIR/ansible_collections/${c/.//}/MANIFEST.json"
  python3 -c 'import json,sys; sys.exit(json.load(open(sys.argv[1]))["collection_info"]["version"] != sys.argv[2])' \
    "$m" "${WANT[$c]}" 2>/dev/null || need=1
done
if [ "$need" = 1 ]; then
  wheels=$(mktemp -d /tmp/kubenode-collections.XXXXXX)
  python3 -m pip download -q --no-deps -d "$wheels" "$ANSIBLE_BUNDLE"
  python3 - "$wheels"/ansible-*.whl "$COLLECTIONS_DIR" "${!WANT[@]}" <<'PY'
import shutil, sys, zipfile
from pathlib import Path
wheel, dest, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for name in names:
        prefix = "ansible_collections/" + name.replace(".", "/") + "/"
        shutil.rmtree(dest / prefix, ignore_errors=True)  # never a mix of two versions
        z.extractall(dest, [m for m in z.namelist() if m.startswith(prefix)])
        print(f"installed {name} into {dest}")
PY
  rm -rf "$wheels"
fi
