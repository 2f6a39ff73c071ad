#!/usr/bin/env bash
# Build (or reuse) the Python environment that runs fedpipe's federation mode on Flower 1.42.
#
# Why a separate environment: flwr 1.42.0 pins typer<0.21, fastapi<0.139, starlette<1.4,
# uvicorn<0.50, packaging<26 and cryptography<51, while .venv carries newer releases that kserve
# and mlflow need. fedpipe's federation code (fedpipe/federation/) runs in this environment; the
# rest of fedpipe stays in .venv.
#
# What goes in: the CPU build of torch 2.13.0 (a local file; no CUDA), the few runtime libraries
# that fedpipe's engine, algorithms and data loaders import (pillow and pyarrow: a site reads its own
# image folders or tables; opacus and scipy: the privacy accountant at the server), flwr==1.42.0 and pytest. fedpipe
# itself is not installed: a .pth file puts this checkout on sys.path (pyproject's explicit
# package list does not name fedpipe.federation yet, so an editable install would miss it).
#
# Usage: scripts/flower-env.sh [VENV_DIR]    (default: .cache/flower-venv)
# Reuses the environment when its stamp matches this script; rebuilds it otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.cache/flower-venv}"
PY="${FEDPIPE_FLOWER_PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.fedpipe-flower-env"
WANT="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"

# One builder at a time: the test suite's two workers (pytest-xdist) each ask for the environment at once, and
# one's `rm -rf` of a half-built venv under the other failed both. The second waits here, then reuses it.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import flwr, torch" 2>/dev/null; then
  echo "flower env: reusing $VENV"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, exactly the CPU file (a bare 'torch' would pull a multi-GB CUDA build).
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" \
  "flwr==1.42.0" \
  "numpy>=1.26,<3" "pydantic>=2.7,<3" "pyyaml>=6" "safetensors>=0.4" "tqdm>=4.66" \
  "minio>=7.2" "tenacity>=8.2" \
  "pillow>=10" "pyarrow>=15" "opacus==1.6.0" "scipy>=1.11" \
  "pytest>=8" "pytest-timeout>=2.3"
# fedpipe from this checkout, without its dependencies (kfp, kserve, mlflow... are not needed at a site).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE/fedpipe-checkout.pth"
"$VENV/bin/python" -c "import flwr, torch, fedpipe; print('flower env: flwr', flwr.__version__, 'torch', torch.__version__)"
echo "$WANT" > "$STAMP"
echo "flower env: built $VENV in $(( $(date +%s) - start ))s"
