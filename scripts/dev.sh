#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs what was asked.
#   bash scripts/dev.sh demo    # the main job: BertLayer through TVM, training steps vs PyTorch
#   bash scripts/dev.sh test    # lint, then the default test suite (slow tests excluded; `-m slow` for them)
#   bash scripts/dev.sh lint    # ruff (lint + format check) and mypy on tvmbridge/ and analysis/
#   bash scripts/dev.sh setup   # only install
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.tvmbridge-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch==2.13.0 first: on this machine pip takes the CPU wheel that lies on disk.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    # the model zoo's timm models: torchvision pinned to torch's pair (--no-deps: it must never
    # replace the CPU torch), timm without its resolver; PyPI's torchvision is CUDA-linked, so its
    # C ops stay unloaded beside the CPU torch and two registrations are guarded (see the script)
    "$VENV/bin/python" -m pip install -q --no-deps "torchvision==0.28.*" timm
    "$VENV/bin/python" scripts/torchvision_cpu.py
    touch "$stamp"
  fi
  # graphviz's `dot` renders the IR pictures; install it where we can (Debian, as root).
  if ! command -v dot >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
        || echo "warning: could not install graphviz; picture tests will be skipped" >&2
    else
      echo "warning: graphviz 'dot' not found; picture tests will be skipped" >&2
    fi
  fi
}

test_workers() {
  # one pytest worker per core, at most 4: a compile is mostly one thread (tracing, TVM's passes),
  # so two workers on two cores took the suite from 28 to 17 minutes (Zen 3); `-n 0` runs it in one process
  local cores
  cores=$(nproc 2>/dev/null || echo 2)
  echo $(( cores < 4 ? cores : 4 ))
}

lint() {
  # configuration in pyproject.toml ([tool.ruff], [tool.mypy])
  "$VENV/bin/ruff" check tvmbridge analysis
  "$VENV/bin/ruff" format --check tvmbridge analysis
  "$VENV/bin/mypy"
}

cmd=${1:-test}; shift || true
setup
case "$cmd" in
  setup) ;;
  demo)  exec "$VENV/bin/python" -m tvmbridge demo "$@" ;;
  lint)  lint ;;
  test)  lint && exec "$VENV/bin/python" -m pytest -n "${TVMBRIDGE_TEST_WORKERS:-$(test_workers)}" "$@" ;;
  *) echo "usage: $0 {demo|test|lint|setup} [args]" >&2; exit 2 ;;
esac
