#!/usr/bin/env bash
# ansible-lint, production profile, offline (CI has no Galaxy). --offline also stops
# ansible-lint from installing this collection into ./.ansible, so its syntax check could not
# resolve kubenode.proxy.* (the role, the modules): a temporary ansible_collections tree with
# a link to this checkout puts the real collection on the path instead, and lint then checks
# the role's module arguments against the real argument specs.
set -euo pipefail
cd "$(dirname "$0")/.."
cols=$(mktemp -d /tmp/kubenode-lint.XXXXXX)
trap 'rm -rf "$cols"' EXIT
mkdir -p "$cols/ansible_collections/kubenode"
ln -s "$PWD" "$cols/ansible_collections/kubenode/proxy"
ANSIBLE_COLLECTIONS_PATH="$cols:${ANSIBLE_COLLECTIONS_PATH:-$HOME/.ansible/collections:/usr/share/ansible/collections}" \
  ansible-lint --offline --profile production "$@"
