#!/usr/bin/env bash
# The test command (README "Run the tests"; CI runs exactly this).
# Installs what is missing, then runs lint, unit, kernel-integration and Ansible tests.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_INSTALL:-0}" = 1 ] || bash scripts/install-deps.sh
python3 -m ruff check .
suites=()
for d in tests/unit tests/integration; do [ -d "$d" ] && suites+=("$d"); done
python3 -m pytest -p no:cacheprovider -ra "${suites[@]}" "$@"
# ansible-test sanity (24 tests: validate-modules, pylint, pep8, yamllint, ...)
[ "${SKIP_SANITY:-0}" = 1 ] || bash scripts/sanity.sh
