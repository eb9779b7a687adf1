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
