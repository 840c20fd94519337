#!/usr/bin/env bash
# Set up (create or reuse .venv, install the project when pyproject.toml changed), then run:
#   ./dev.sh demo [ARGS]   the main job: robustbn demo
#   ./dev.sh test [ARGS]   the whole test suite (HYPOTHESIS_PROFILE=ci for >= 500 examples a property)
#   ./dev.sh setup         only set up
set -euo pipefail
cd "$(dirname "$0")"

VENV=${ROBUSTBN_VENV:-.venv}
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "dev.sh: needs Python >= 3.11 as \$PYTHON (now: $PYTHON, $("$PYTHON" --version 2>&1 || echo missing))" >&2
  exit 2
fi

# setup EXTRAS: install the project with those extras when pyproject.toml or EXTRAS changed
setup() {
  local extras=$1
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local want stamp="$VENV/.robustbn-installed"
  want=$({ cat pyproject.toml; echo "$extras"; } | "$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev.sh: installing robustbn[$extras] and its dependencies into $VENV (first time: a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
    echo "$want" > "$stamp"
  fi
}

# Fashion-MNIST, the offline default dataset: Debian's package where apt-get is usable;
# elsewhere torchvision downloads it on first use.
fashion_mnist() {
  [ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && return 0
  command -v apt-get >/dev/null 2>&1 || return 0
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo -n true 2>/dev/null || return 0
    sudo="sudo -n"
  fi
  echo "dev.sh: installing Debian's dataset-fashion-mnist" >&2
  { $sudo apt-get update -qq && $sudo apt-get install -y -qq dataset-fashion-mnist; } >/dev/null 2>&1 \
    || echo "dev.sh: apt-get could not install dataset-fashion-mnist; torchvision will download it" >&2
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup test,ray,flower; fashion_mnist ;;
  demo) setup test; fashion_mnist; exec "$VENV/bin/robustbn" demo "$@" ;;
  test) setup test,ray,flower; fashion_mnist; exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@" ;;
  *) echo "usage: ./dev.sh {demo|test|setup} [ARGS]" >&2; exit 2 ;;
esac
