#!/usr/bin/env bash
# Set up (create or reuse .venv, install the project when pyproject.toml changed), then run:
#   ./dev.sh demo [ARGS]   the main job: robustbn demo
#   ./dev.sh test [ARGS]   the whole test suite (HYPOTHESIS_PROFILE=ci: 500 examples a property)
#   ./dev.sh docs          docs/results.md's tables and verdicts and docs/report/ from docs/results.csv
#   ./dev.sh docs --check  exit non-zero where docs/results.md or docs/report/ is not what docs/results.csv gives
#   ./dev.sh setup         only set up
set -euo pipefail
cd "$(dirname "$0")"

VENV=${ROBUSTBN_VENV:-.venv}
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "dev.sh: needs Python >= 3.11 as \$PYTHON (now: $PYTHON, $("$PYTHON" --version 2>&1 || echo missing))" >&2
  exit 2
fi

# pip's configuration (index-url, extra-index-url, find-links, constraint; its environment
# variables first) as uv's options, one a line: uv reads no pip.conf
uv_options() {
  "$VENV/bin/python" -m pip config list 2>/dev/null | "$VENV/bin/python" -c '
import shlex, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
seen = {}
for line in sys.stdin:  # lines like global.find-links='"'"'/opt/wheels'"'"' or :env:.find-links=...
    key, _, value = line.strip().partition("=")
    where, _, name = key.rpartition(".")
    if name in flags and (name not in seen or where == ":env:"):
        seen[name] = shlex.split(value)[0].split() if value else []
for name, values in seen.items():
    for v in values:
        print(flags[name]); print(v)
print("--index-strategy"); print("unsafe-best-match")  # as pip: the best version over every index'
}

# install SPEC into the venv: with uv where it can be had (torch's 5 GB in about a quarter of
# pip's time: docs/performance.md), else pip. Neither byte-compiles: Python compiles the modules
# imported, once, when imported (pip would compile all of torch's, about a minute)
install() {
  if [ -z "${ROBUSTBN_NO_UV:-}" ] && { [ -x "$VENV/bin/uv" ] ||
       "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check uv >/dev/null 2>&1; }; then
    local opts
    mapfile -t opts < <(uv_options)
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" "${opts[@]}" -e "$1" && return 0
    echo "dev.sh: uv could not install it; trying pip" >&2
  fi
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile -e "$1"
}

# setup [EXTRAS]: install the project (with those extras) when pyproject.toml or EXTRAS changed
setup() {
  local extras=${1:-}
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local want stamp="$VENV/.robustbn-installed"
  want=$({ cat pyproject.toml; echo "$extras"; } | "$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    local spec=.
    [ -z "$extras" ] || spec=".[$extras]"
    echo "dev.sh: installing robustbn${extras:+[$extras]} and its dependencies into $VENV (first time: a few minutes)" >&2
    install "$spec"
    [ -z "$extras" ] || compile_imports  # the demo's three processes would not win back its 15-24 s
    echo "$want" > "$stamp"
  fi
}

# Byte-compile what the runs and the tests import (the installs compile nothing). Where
# PYTHONDONTWRITEBYTECODE is set, as on CI's machines, nothing would ever write them, and every
# process the tests start compiled torch's modules again: about 4 CPU minutes a test suite.
compile_imports() {
  env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" - <<'PY' >/dev/null 2>&1 || true
import importlib
for name in ("robustbn.cli", "robustbn.engine", "robustbn.plots", "torchvision", "scipy.stats", "matplotlib.pyplot",
             "tqdm", "optuna", "hypothesis", "pytest", "xdist", "cogapp", "ray", "flwr", "flwr.serverapp",
             "flwr.clientapp", "playwright.sync_api"):
    try:
        importlib.import_module(name)
    except Exception:  # an extra not installed: nothing of it to compile
        pass
PY
}

# Debian packages the tests use, where apt-get is usable (root or passwordless sudo):
# dataset-fashion-mnist (the offline default dataset; elsewhere torchvision downloads it) and
# chromium (the report page's browser test; elsewhere that test is skipped, saying why).
apt_install() {  # PACKAGE WHAT
  command -v apt-get >/dev/null 2>&1 || return 0
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null || return 0
    sudo="sudo -n"
  fi
  echo "dev.sh: installing Debian's $1" >&2
  { $sudo apt-get update -qq && $sudo apt-get install -y -qq "$1"; } >/dev/null 2>&1 \
    || echo "dev.sh: apt-get could not install $1; $2" >&2
}
fashion_mnist() {
  [ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && return 0
  apt_install dataset-fashion-mnist "torchvision will download it"
}
browser() {
  command -v chromium >/dev/null 2>&1 && return 0
  apt_install chromium "the browser test of the report page will be skipped"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup test,ray,flower; fashion_mnist; browser ;;
  demo) setup; fashion_mnist; exec "$VENV/bin/robustbn" demo "$@" ;;  # the demo needs no test tools
  test) setup test,ray,flower; fashion_mnist; browser; exec "$VENV/bin/python" -m pytest -p no:cacheprovider -n auto --dist worksteal "$@" ;;
  docs)
    setup test,ray,flower
    if [ "${1:-}" = --check ]; then
      "$VENV/bin/python" docs/tables.py --cog --check && exec "$VENV/bin/python" docs/tables.py --page --check
    fi
    [ $# -eq 0 ] || { echo "usage: ./dev.sh docs [--check]" >&2; exit 2; }
    "$VENV/bin/python" docs/tables.py --cog
    exec "$VENV/bin/python" docs/tables.py --page docs/report ;;
  *) echo "usage: ./dev.sh {demo|test|docs|setup} [ARGS]" >&2; exit 2 ;;
esac
