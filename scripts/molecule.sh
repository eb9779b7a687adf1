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

# What the VM lab needs on the host (qemu, an image builder, ssh) and molecule itself: one
# list, in install-deps.sh.
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install-deps.sh

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
