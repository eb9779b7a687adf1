#!/usr/bin/env bash
# The test command (README "Run the tests"; CI runs exactly this).
# Installs what is missing, then runs lint, unit, kernel-integration and Ansible tests.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install-deps.sh
python3 -m ruff check .
# Ansible content: ansible-lint (production profile, offline, ~30 s) and the changelog fragments (~1 s).
bash scripts/lint.sh
antsibull-changelog lint
# The VM image (Debian + stock kernel, for IPVS and systemd) is built once and cached outside
# the checkout; building it here keeps its few minutes visible in the log.
[ "${SKIP_VM:-0}" = 1 ] || python3 tests/vm/vmlab.py image
suites=(tests/unit tests/integration)
[ "${SKIP_VM:-0}" = 1 ] || suites+=(tests/vm)
python3 -m pytest -p no:cacheprovider -ra "${suites[@]}" "$@"
# The role's molecule scenario on two VMs (iptables and IPVS mode): converge, idempotence, verify.
[ "${SKIP_VM:-0}" = 1 ] || SKIP_INSTALL=1 bash scripts/molecule.sh
# ansible-test sanity (24 tests: validate-modules, pylint, pep8, yamllint, ...)
[ "${SKIP_SANITY:-0}" = 1 ] || bash scripts/sanity.sh
