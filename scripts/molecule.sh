#!/usr/bin/env bash
# Molecule scenarios of the kube_proxy role (molecule/*/molecule.yml) on VMs of the VM lab
# (tests/vm/vmlab.py: Debian bookworm under qemu, software emulation; the image is built
# once, ~4 min, and cached outside the repository). Needs root (image build, qemu).
#
#   bash scripts/molecule.sh                  # molecule test --all (the CI entry)
#   bash scripts/molecule.sh test -s default  # any molecule command and arguments
#   bash scripts/molecule.sh converge         # keep the VMs for a look: ... login -h node-ipvs
#   bash scripts/molecule.sh destroy
#
# Environment: MOLECULE_GLOB (default molecule/*/molecule.yml), KUBENODE_VMLAB_CACHE (image
# cache), SKIP_INSTALL=1 (do not install missing Debian/Python packages).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  # What the VM lab needs on the host (qemu, an image builder, ssh) and molecule itself.
  pkgs=(qemu-system-x86 qemu-utils debootstrap openssh-client e2fsprogs util-linux tar)
  missing=()
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  python3 -c 'import molecule' 2>/dev/null || python3 -m pip install -q -r requirements.txt
fi

# The role and the module it uses are found as the collection kubenode.proxy: expose this
# checkout as <dir>/ansible_collections/kubenode/proxy (a private symlink per checkout).
collections=$(mktemp -d /tmp/kubenode-molecule.XXXXXX)
trap 'rm -rf "$collections"' EXIT
mkdir -p "$collections/ansible_collections/kubenode"
ln -s "$root" "$collections/ansible_collections/kubenode/proxy"
export ANSIBLE_COLLECTIONS_PATH="$collections${ANSIBLE_COLLECTIONS_PATH:+:$ANSIBLE_COLLECTIONS_PATH}"

# Scenarios live in molecule/ (molecule 26 would look in extensions/molecule/ of a collection).
export MOLECULE_GLOB="${MOLECULE_GLOB:-molecule/*/molecule.yml}"
export ANSIBLE_FORCE_COLOR="${ANSIBLE_FORCE_COLOR:-0}"

if [ "$#" -eq 0 ]; then
  set -- test --all
fi
started=$(date +%s)
status=0
python3 -m molecule "$@" || status=$?
echo "molecule $*: exit $status in $(( $(date +%s) - started )) s"
exit "$status"
