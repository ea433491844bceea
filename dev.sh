#!/usr/bin/env bash
# One entry point for a fresh Debian machine: installs what is missing (a venv with the package
# and its dev tools; redis-server via apt when no server binary is found), then runs
#   bash dev.sh demo    the demo (examples/) against a local Redis it starts; --seconds N
#   bash dev.sh test    every check: ruff, mypy, the docs site (strict), the whole pytest suite
#   bash dev.sh bench   the benchmarks (bench/README.md)
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '\033[1m[dev]\033[0m %s\n' "$*" >&2; }

have_server() {
  [ -n "${REDIS_SERVER_BIN:-}" ] && [ -x "${REDIS_SERVER_BIN}" ] && return 0
  command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1
}

apt_install() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
  if [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; then return 1; fi
  command -v apt-get >/dev/null 2>&1 || return 1
  log "apt-get install $*"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

ensure_server() {
  have_server && return 0
  apt_install redis-server || true
  have_server && return 0
  log "no redis-server found and apt-get is not usable; set REDIS_SERVER_BIN or REDIS_URL"
  return 0  # the demo falls back to memory://; the tests say precisely what is missing
}

ensure_venv() {
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    if ! python3 -m venv .venv 2>/dev/null; then
      rm -rf .venv
      apt_install python3-venv python3-pip || { log "python3 -m venv failed; install python3-venv"; exit 1; }
      python3 -m venv .venv
    fi
  fi
  local stamp=.venv/.aiolimit-installed
  local want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "installing aiolimit[dev] into .venv"
    .venv/bin/python -m pip install -q --disable-pip-version-check -U pip
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    ensure_server; ensure_venv
    # The repository root on sys.path: the demo starts its server with cluster/, which is the
    # repository's tooling and not part of the installed package.
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec .venv/bin/python examples/demo.py "$@"
    ;;
  test)
    ensure_server; ensure_venv
    log "ruff"
    .venv/bin/ruff check aiolimit cluster bench tests examples
    .venv/bin/ruff format --check aiolimit cluster bench tests examples
    log "mypy --strict aiolimit"
    .venv/bin/mypy
    log "docs: mkdocs build --strict (a broken reference fails)"
    site=$(mktemp -d)
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet -d "$site"
    rm -rf "$site"
    log "pytest"
    exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
    ;;
  bench)
    ensure_server; ensure_venv
    exec .venv/bin/python -m bench.bench "$@"
    ;;
  *)
    echo "usage: bash dev.sh demo|test|bench [args...]" >&2
    exit 2
    ;;
esac
