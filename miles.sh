#!/usr/bin/env bash
# Quick start wrapper: bootstraps a virtualenv on first use, then runs miles or the tests.
#   ./miles.sh train examples/quickstart.toml    # the end-to-end RL run on CPU
#   ./miles.sh test                              # the test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")"
VENV="${MILES_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.miles-installed" ]; then
  python3 -m venv "$VENV"
  # The CPU build of torch 2.13.0 is on this machine's disk; pin it so no CUDA build is pulled.
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q -e '.[dev,tb,ucx]'  # ucx: UCXX over TCP on CPU too
  touch "$VENV/.miles-installed"
fi
cmd="${1:-}"
shift || true
case "$cmd" in
  test) exec "$VENV/bin/python" -m pytest -q "$@" ;;
  "") echo "usage: ./miles.sh train CONFIG.toml | test | <any miles subcommand>" >&2; exit 2 ;;
  *) exec "$VENV/bin/miles" "$cmd" "$@" ;;
esac
