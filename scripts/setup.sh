#!/usr/bin/env bash
# Creates .venv with the pinned torch/torchvision pair and fedpipe installed (editable).
# Usage: scripts/setup.sh [--test]   (--test adds the test tools)
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "fedpipe needs Python 3.11; found $("$PYTHON" --version 2>&1). Set PYTHON=/path/to/python3.11." >&2
  exit 1
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check"
# Some machines point pip at local index folders that lack most projects; pip warns once per
# project it looks up there. Those lines are noise, everything else pip says is kept.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# torchvision on PyPI is built against the CUDA torch of the same release; a CPU-only torch
# wheel from a local find-links folder (some machines carry one) would break `import torchvision`.
# So the pair is resolved from the index alone, with find-links pointed at an empty folder.
if ! .venv/bin/python -c 'import torch, torchvision, sys; sys.exit(not (torch.__version__.startswith("2.13.0") and torchvision.__version__.startswith("0.28.0")))' 2>/dev/null; then
  echo "Installing torch 2.13.0 + torchvision 0.28.0 (a few GB, the first time only)..."
  empty=$(mktemp -d)
  PIP_FIND_LINKS="$empty" quiet $PIP install -q "torch==2.13.0" "torchvision==0.28.0"
  rmdir "$empty"
fi

extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
quiet $PIP install -q -e ".${extra}"
echo "fedpipe is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))."
