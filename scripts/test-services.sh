#!/usr/bin/env bash
# Installs what the integration tests (pytest -m services) need, if it is missing:
#   - Prometheus and the Prometheus Pushgateway (Debian packages);
#   - the real Fashion-MNIST (Debian package dataset-fashion-mnist, 30 MB: the four original idx .gz files
#     under /usr/share/datasets/fashion-mnist/, which tests/test_idx.py trains on for a few seconds);
#   - the S3-compatible test server `moto_server` (pip, the `test` extra of fedpipe);
#   - nginx (Debian package nginx-light, as in the image): tests/deploy/test_superlink_chart.py runs the chart's
#     SuperLink filter config in the real nginx in front of a real flower-superlink;
#   - what draws the documentation site's pictures (tests/test_docs_site.py builds it): Graphviz's `dot` and
#     Chromium (Debian packages graphviz, chromium), and the DejaVu fonts both draw text with.
# Usage: scripts/test-services.sh [--docs]   (--docs: only the documentation's tools, for `make docs`)
# It does not start anything: the fixtures in tests/conftest.py start the servers on free loopback
# ports and stop them at the end of the session. Safe to run again; quiet when all is there.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "test-services.sh: not root and no sudo; install prometheus and prometheus-pushgateway yourself." >&2
    exit 1
  fi
fi

have_bin() {
  command -v "$1" >/dev/null 2>&1 || [ -x "/usr/bin/$1" ] || [ -x "/usr/sbin/$1" ]
}

docs_missing=()
have_bin dot || docs_missing+=(graphviz)
have_bin chromium || docs_missing+=(chromium)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || docs_missing+=(fonts-dejavu-core)
apt_install() {
  echo "Installing $* (apt)..."
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}
if [ "${1:-}" = "--docs" ]; then
  [ "${#docs_missing[@]}" -eq 0 ] || apt_install "${docs_missing[@]}"
  for b in dot chromium; do
    have_bin "$b" || { echo "test-services.sh: $b is still missing after apt-get install." >&2; exit 1; }
  done
  exit 0
fi

missing=("${docs_missing[@]}")
have_bin prometheus || missing+=(prometheus)
have_bin prometheus-pushgateway || missing+=(prometheus-pushgateway)
have_bin nginx || missing+=(nginx-light)
FASHION_MNIST=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
[ -f "$FASHION_MNIST" ] || missing+=(dataset-fashion-mnist)
if [ "${#missing[@]}" -gt 0 ]; then
  apt_install "${missing[@]}"
  # The Debian packages start system services where an init system runs; the tests start their
  # own copies on free ports, so those are not needed (and not touched here).
fi

PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
  echo "test-services.sh: $PY not found; run scripts/setup.sh --test first." >&2
  exit 1
fi
if [ ! -x "$(dirname "$PY")/moto_server" ]; then
  echo "Installing moto[server] into $(dirname "$(dirname "$PY")") (pip)..."
  "$PY" -m pip install -q --disable-pip-version-check "moto[server]>=5"
fi

for b in prometheus prometheus-pushgateway nginx dot chromium; do
  have_bin "$b" || { echo "test-services.sh: $b is still missing after apt-get install." >&2; exit 1; }
done
[ -f "$FASHION_MNIST" ] || { echo "test-services.sh: $FASHION_MNIST is still missing after apt-get install dataset-fashion-mnist." >&2; exit 1; }
