#!/usr/bin/env bash
# ansible-test sanity on a copy of the collection in an ansible_collections/kubenode/proxy tree.
# ansible-test first wants to download pip's bootstrap script; this machine has no internet
# beyond package registries, so we give it a stand-in that uses ensurepip + pip install.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/kubenode-sanity.XXXXXX)
trap 'rm -rf "$work"' EXIT

cache="$HOME/.ansible/test/cache"
mkdir -p "$cache"
for v in 24_2 25_3; do
  f="$cache/get_pip_${v}.py"
  grep -q ensurepip "$f" 2>/dev/null || cat > "$f" <<'PY'
import subprocess, sys
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "ensurepip"])
subprocess.check_call([sys.executable, "-m", "pip", "install", *args])
PY
done

dest="$work/ansible_collections/kubenode/proxy"
mkdir -p "$dest"
# Only tracked and new (not ignored) files: what a build of the collection would contain.
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] || continue
  mkdir -p "$dest/$(dirname "$f")"
  cp -p "$f" "$dest/$f"
done
cd "$dest"
git init -q . && git add -A >/dev/null
ansible-test sanity --local --python 3.11 --color no "$@"
