#!/usr/bin/env bash
# Quick start wrapper: bootstraps a virtualenv on first use, then runs miles or the tests.
#   ./miles.sh train examples/quickstart.toml    # the end-to-end RL run on CPU
#   ./miles.sh test                              # the test suite (what CI runs)
# It (re)installs when the virtualenv is missing or pyproject.toml (the dependency list) has
# changed since the last install: the marker file holds the hash of the pyproject.toml it
# installed from. MILES_VENV picks another virtualenv directory.
# It runs in the caller's directory: a path given on its command line (a config, --set) is
# relative to where it is called from, one written in a config file to that file's folder, as
# for `.venv/bin/miles` itself; only the install runs in the repo.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
VENV="${MILES_VENV:-$ROOT/.venv}"
MARKER="$VENV/.miles-installed"
say() { echo "miles.sh: $*" >&2; }
want="$(python3 -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$ROOT/pyproject.toml")"
have="$(cat "$MARKER" 2>/dev/null || true)"
if [ ! -x "$VENV/bin/python" ] || [ "$have" != "$want" ]; then
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    say "miles needs Python >= 3.11; python3 is $(python3 -V 2>&1). Put a newer python3 first on PATH."
    exit 1
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating the virtualenv $VENV ($(python3 -V 2>&1)); first run only, a few minutes"
    python3 -m venv "$VENV"
  elif [ -z "$have" ]; then
    say "$VENV has no record of what it installed: installing the dependencies of pyproject.toml"
  else
    say "pyproject.toml changed since $VENV was installed: updating the dependencies"
  fi
  # The CPU build of torch 2.13.0, pinned first so that no CUDA build is pulled in. Where the
  # default index serves CUDA builds, set PIP_INDEX_URL to PyTorch's CPU-only wheel index first.
  say "installing torch==2.13.0 (CPU) ..."
  "$VENV/bin/pip" install -q torch==2.13.0
  say "installing miles with extras dev,tb,ucx (editable) ..."
  (cd "$ROOT" && "$VENV/bin/pip" install -q -e '.[dev,tb,ucx]')  # ucx: UCXX over TCP on CPU too
  echo "$want" > "$MARKER"
  say "done; $VENV is up to date with pyproject.toml"
fi
cmd="${1:-}"
shift || true
case "$cmd" in
  # the repo's pytest settings wherever it is called from; no test path given: the repo's tests
  test) given=0
        for a in "$@"; do [ -e "${a%%::*}" ] && given=1; done
        [ "$given" = 1 ] || set -- "$@" "$ROOT/tests"
        exec "$VENV/bin/python" -m pytest -q -c "$ROOT/pyproject.toml" --rootdir "$ROOT" "$@" ;;
  "") echo "usage: ./miles.sh train CONFIG.toml | test | <any miles subcommand>" >&2; exit 2 ;;
  # MILES_PROG: the commands miles prints (e.g. how to resume a run) start the way this one did
  *) MILES_PROG="$0" exec "$VENV/bin/miles" "$cmd" "$@" ;;
esac
