#!/usr/bin/env bash
# Builds fedpipe's container image with podman/buildah (no Docker engine needed), pushes it to a registry on
# loopback and pulls it back from there, as a cluster node would. Writes the pulled reference to
# .cache/images/fedpipe-image.txt, which the tests read (tests/containers.py).
#
# Usage: scripts/build-images.sh [--stop-registry]
# Environment (all optional):
#   FEDPIPE_TORCH=cuda|cpu     which build: cuda (default) takes torch from PyPI (CUDA 13 wheels, also runs on
#                              CPU), tag <version>-cuda; cpu takes it from PyTorch's CPU index, tag <version>
#                              (download.pytorch.org must be reachable for that one).
#   FEDPIPE_BASE_IMAGE         the base image (default localhost/fedpipe-base:bookworm-py3.11, made here with
#                              debootstrap because no registry image can be pulled on these machines; elsewhere
#                              pass python:3.11-slim-bookworm).
#   FEDPIPE_REGISTRY_PORT      port of the loopback registry (default 5000; a registry already there is reused).
#   DEBIAN_MIRROR              the Debian mirror for debootstrap (default: the one apt's sources use).
# Safe to run again: the base is made once, layers come from podman's cache (a fedpipe source change rebuilds
# only the last, small layer), and wheels are downloaded once into .cache/wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

STATE=.cache/images                # ignored by .gitignore (.cache/)
WHEELS=.cache/wheels               # pip wheels of every dependency, shared with the host's pip
PORT=${FEDPIPE_REGISTRY_PORT:-5000}
REGISTRY=127.0.0.1:$PORT
BASE_IMAGE=${FEDPIPE_BASE_IMAGE:-localhost/fedpipe-base:bookworm-py3.11}
TORCH=${FEDPIPE_TORCH:-cuda}
NAME=fedpipe/fedpipe
REF_FILE=$STATE/fedpipe-image.txt
mkdir -p "$STATE" "$WHEELS"

say() { printf '[build-images %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf 'build-images.sh: %s\n' "$*" >&2; exit 1; }
since() { echo "$(($(date +%s) - $1))s"; }

registry_up() { curl -fsS -o /dev/null "http://$REGISTRY/v2/" 2>/dev/null; }

if [ "${1:-}" = "--stop-registry" ]; then
  if [ -f "$STATE/registry.pid" ] && kill "$(cat "$STATE/registry.pid")" 2>/dev/null; then
    say "stopped the registry on $REGISTRY"
  fi
  rm -f "$STATE/registry.pid"
  exit 0
fi
[ $# -eq 0 ] || die "unknown argument: $1 (usage: scripts/build-images.sh [--stop-registry])"

case "$TORCH" in
  cuda) TORCH_INDEX_URL="" ;;
  cpu) TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu" ;;
  *) die "FEDPIPE_TORCH must be cuda or cpu, not '$TORCH'" ;;
esac
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
[ -n "$VERSION" ] || die "no version found in pyproject.toml"
TAG=$VERSION
[ "$TORCH" = cuda ] && TAG=$VERSION-cuda
LOCAL_REF=localhost/$NAME:$TAG
REMOTE_REF=$REGISTRY/$NAME:$TAG

# --- 1. Debian packages ------------------------------------------------------------------------------------
SUDO=""
if [ "$(id -u)" != "0" ]; then
  command -v sudo >/dev/null 2>&1 && SUDO="sudo" || SUDO="none"
fi
as_root() {
  [ "$SUDO" = none ] && die "this step needs root (or sudo): $*"
  $SUDO "$@"
}
missing=()
for pair in podman:podman buildah:buildah debootstrap:debootstrap runc:runc docker-registry:docker-registry curl:curl; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || missing+=("${pair#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$SUDO" = none ] && die "missing ${missing[*]}; install them as root: apt-get install -y ${missing[*]}"
  say "installing ${missing[*]} (apt)..."
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
export PATH=$PATH:/usr/sbin:/sbin

# --- 2. podman settings --------------------------------------------------------------------------------------
# System-wide (a drop-in of /etc/containers/containers.conf.d, read by every podman call, including the tests'
# `podman run` and `podman system service`): crun fails on these machines' cgroups, and podman's default
# container ulimits are above the hard limits the sandbox allows ("error setting rlimit ... operation not
# permitted"). Written only when no containers.conf sets them already. The ulimits follow this shell's own
# hard limits, so they are never above what a process here may have.
if ! cat /etc/containers/containers.conf /etc/containers/containers.conf.d/*.conf 2>/dev/null | grep -q '^ *default_ulimits'; then
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  [ "$nofile" = unlimited ] && nofile=1048576
  [ "$nproc" = unlimited ] && nproc=32768
  [ "$nofile" -gt 20000 ] && nofile=20000
  [ "$nproc" -gt 32768 ] && nproc=32768
  say "writing /etc/containers/containers.conf.d/50-fedpipe.conf (runc, ulimits nofile=$nofile nproc=$nproc)"
  as_root mkdir -p /etc/containers/containers.conf.d
  printf '# Written by fedpipe scripts/build-images.sh: crun fails here, default ulimits exceed the hard limits.\n[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n\n[engine]\nruntime = "runc"\n' \
    "$nofile" "$nofile" "$nproc" "$nproc" | as_root tee /etc/containers/containers.conf.d/50-fedpipe.conf >/dev/null
fi
# The loopback registry speaks plain HTTP: mark it insecure (as a cluster's containerd config would) so that
# `podman pull 127.0.0.1:PORT/...` works without --tls-verify=false, in this script and in the tests.
REGCONF=/etc/containers/registries.conf.d/50-fedpipe-local.conf
if ! grep -qs "location = \"$REGISTRY\"" "$REGCONF"; then
  say "writing $REGCONF ($REGISTRY is a plain-HTTP registry)"
  as_root mkdir -p /etc/containers/registries.conf.d
  printf '# Written by fedpipe scripts/build-images.sh: the loopback test registry has no TLS.\n[[registry]]\nlocation = "%s"\ninsecure = true\n' \
    "$REGISTRY" | as_root tee -a "$REGCONF" >/dev/null
fi
[ "$SUDO" = none ] && die "podman needs root here (rootless podman was not tried on these machines); run as root"
PODMAN="$SUDO podman"

# --- 3. the base image ---------------------------------------------------------------------------------------
debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local url
  url=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/\?$/\1/p' | head -1)
  [ -n "$url" ] || url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | sed -n 's/^deb \(\[[^]]*\] \)\?\(http[^ ]*\/debian\)\/\? .*/\2/p' | head -1)
  echo "${url:-http://deb.debian.org/debian}"
}
if $PODMAN image exists "$BASE_IMAGE"; then
  say "base image $BASE_IMAGE: present"
elif [[ "$BASE_IMAGE" != localhost/* ]]; then
  say "pulling base image $BASE_IMAGE..."
  $PODMAN pull -q "$BASE_IMAGE" >/dev/null
else
  # No registry image can be pulled here: the equivalent of python:3.11-slim-bookworm is made from Debian's
  # own packages (Python 3.11.2), with `python`/`pip` in /usr/local/bin as in the official image.
  t0=$(date +%s)
  mirror=$(debian_mirror)
  rootfs=$STATE/rootfs
  as_root rm -rf "$rootfs"
  say "making base image $BASE_IMAGE with debootstrap from $mirror (about a minute)..."
  as_root debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv,passwd \
    bookworm "$rootfs" "$mirror" > "$STATE/debootstrap.log" 2>&1 \
    || die "debootstrap failed; see $STATE/debootstrap.log"
  # This machine reaches PyPI through a proxy with its own CA: the base must trust the same extra CA
  # certificates as the host, or pip inside the build fails with "self-signed certificate in certificate chain".
  # (A base elsewhere, e.g. python:3.11-slim, needs none of this.)
  shopt -s nullglob
  cas=(/usr/local/share/ca-certificates/*.crt)
  shopt -u nullglob
  [ "${#cas[@]}" -eq 0 ] || as_root cp "${cas[@]}" "$rootfs/usr/local/share/ca-certificates/"
  as_root chroot "$rootfs" update-ca-certificates > /dev/null 2>&1
  as_root chroot "$rootfs" python3 -m venv /usr/local
  as_root rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  bundle=/etc/ssl/certs/ca-certificates.crt
  as_root tar -C "$rootfs" -c . | $PODMAN import -q \
    --change "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" \
    --change "ENV PIP_CERT=$bundle" --change "ENV SSL_CERT_FILE=$bundle" --change "ENV REQUESTS_CA_BUNDLE=$bundle" \
    --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
  as_root rm -rf "$rootfs"
  say "base image $BASE_IMAGE made in $(since "$t0")"
fi

# --- 4. wheels -----------------------------------------------------------------------------------------------
# Every dependency as a wheel in .cache/wheels, made by the host's pip (same Python 3.11, same platform), so
# the build installs them offline (pip --no-index) and a rebuild downloads nothing. pip's HTTP cache does not
# help on these machines (the proxy strips the caching headers), hence a folder. Only for the PyPI torch:
# the CPU build takes its torch from PyTorch's index inside the build.
build_args=(--build-arg "VERSION=$VERSION" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
HOSTPY=""
for py in .venv/bin/python python3.11 python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
     && "$py" -m pip --version >/dev/null 2>&1; then HOSTPY=$py; break; fi
done
if [ "$TORCH" = cuda ] && [ -n "$HOSTPY" ]; then
  reqs=$STATE/requirements.txt
  "$HOSTPY" -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['serve'], *p['optional-dependencies']['hub'], sep='\n')" > "$reqs"  # as images/Dockerfile's requirements stage
  printf 'setuptools>=68\nwheel\n' >> "$reqs"   # fedpipe's own build requirements (pyproject.toml [build-system])
  grep -v '^#' images/flower-requirements.txt | sed 's/^/# flower: /' >> "$reqs"  # a change of it collects again
  if ! cmp -s "$reqs" "$WHEELS/.requirements.done"; then
    t0=$(date +%s)
    say "collecting wheels into $WHEELS with $HOSTPY (the first time: ~3 GB, about a minute)..."
    empty=$(mktemp -d)
    # An empty find-links: some machines carry a CPU-only torch wheel there, which PyPI's torchvision cannot use.
    PIP_FIND_LINKS="$empty" "$HOSTPY" -m pip wheel -q --disable-pip-version-check -w "$WHEELS" -r "$reqs" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    # Flower's own set apart: its pins (older typer, fastapi...) conflict with the list above (images/Dockerfile's /opt/flower)
    PIP_FIND_LINKS="$empty" "$HOSTPY" -m pip wheel -q --disable-pip-version-check -w "$WHEELS" -r images/flower-requirements.txt \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    rmdir "$empty"
    cp "$reqs" "$WHEELS/.requirements.done"
    say "wheels ready in $(since "$t0") ($(du -sh "$WHEELS" | cut -f1))"
  else
    say "wheels in $WHEELS: up to date"
  fi
  build_args+=(--build-context "wheels=$REPO/$WHEELS" --build-arg WHEELS_ONLY=1)
else
  say "no local wheels (FEDPIPE_TORCH=$TORCH or no Python 3.11 with pip here): the build downloads its packages"
fi

# --- 5. build --------------------------------------------------------------------------------------------------
t0=$(date +%s)
say "building $LOCAL_REF from $BASE_IMAGE (torch: ${TORCH_INDEX_URL:-PyPI, CUDA build})..."
$PODMAN build --layers -q -f images/Dockerfile --ignorefile images/Dockerfile.dockerignore \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" "${build_args[@]}" -t "$LOCAL_REF" . > "$STATE/build.log" 2>&1 \
  || { tail -40 "$STATE/build.log" >&2; die "podman build failed (full log: $STATE/build.log)"; }
image_id=$($PODMAN image inspect --format '{{.Id}}' "$LOCAL_REF")
say "built $LOCAL_REF (${image_id:0:12}, $($PODMAN image inspect --format '{{.Size}}' "$LOCAL_REF" | awk '{printf "%.2f GB", $1/1e9}')) in $(since "$t0")"

# --- 6. registry on loopback ----------------------------------------------------------------------------------
if registry_up; then
  say "registry on $REGISTRY: already running"
else
  mkdir -p "$STATE/registry"
  cat > "$STATE/registry.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $REPO/$STATE/registry
  delete:
    enabled: true
http:
  addr: $REGISTRY
EOF
  say "starting docker-registry on $REGISTRY (storage: $STATE/registry, log: $STATE/registry.log)"
  setsid nohup docker-registry serve "$STATE/registry.yml" > "$STATE/registry.log" 2>&1 < /dev/null &
  echo $! > "$STATE/registry.pid"
  for _ in $(seq 50); do registry_up && break; sleep 0.2; done
  registry_up || { tail -5 "$STATE/registry.log" >&2; die "the registry did not start on $REGISTRY (port taken?)"; }
fi

# --- 7. push, drop the local tag, pull back ----------------------------------------------------------------
# The push compresses every layer into a temporary file before it uploads it, the registry keeps the compressed
# blobs and the fresh-node pull below unpacks the image once more: with less free than twice the image's size,
# one of them fails half-way with "no space left on device" (seen in CI) and leaves gigabytes behind. Say so
# before starting, and keep the push's temporary files in $STATE/tmp, removed whatever happens.
image_bytes=$($PODMAN image inspect --format '{{.Size}}' "$LOCAL_REF")
# Each rebuild leaves the previous fedpipe image untagged (gigabytes when the dependency layer changed); drop
# those first: only dangling images with fedpipe's own title label, nothing of anyone else's.
pruned=$($PODMAN image prune -f --filter label=org.opencontainers.image.title=fedpipe 2>/dev/null | wc -l)
[ "$pruned" -gt 0 ] && say "dropped $pruned untagged earlier fedpipe build(s)"
free_bytes=$(( $(df -Pk "$STATE" | awk 'NR==2 {print $4}') * 1024 ))
if [ "$free_bytes" -lt $(( 2 * image_bytes )) ]; then
  die "the push needs about $(( 2 * image_bytes / 1000000000 + 1 )) GB free on the disk of $REPO/$STATE, and only \
$(( free_bytes / 1000000000 )) GB is. Free some: 'podman image prune -f' drops untagged images, 'podman system df' shows \
what the images take, and old clones or virtual environments are often the rest."
fi
push_tmp=$REPO/$STATE/tmp
rm -rf "$push_tmp" && mkdir -p "$push_tmp"
trap 'rm -rf "$push_tmp"' EXIT
t0=$(date +%s)
say "pushing $REMOTE_REF..."
TMPDIR=$push_tmp $PODMAN push -q "$LOCAL_REF" "$REMOTE_REF" > "$STATE/push.log" 2>&1 \
  || { cat "$STATE/push.log" >&2; die "push to $REGISTRY failed"; }
rm -rf "$push_tmp"
say "pushed in $(since "$t0")"
$PODMAN untag "$LOCAL_REF"
$PODMAN image exists "$REMOTE_REF" && $PODMAN untag "$REMOTE_REF"
t0=$(date +%s)
say "pulling $REMOTE_REF back..."
$PODMAN pull -q "$REMOTE_REF" > "$STATE/pull.log" 2>&1 || { cat "$STATE/pull.log" >&2; die "pull from $REGISTRY failed"; }
[ "$($PODMAN image inspect --format '{{.Id}}' "$REMOTE_REF")" = "$image_id" ] || die "the pulled image is not the one built"
say "pulled in $(since "$t0")"
# The build tag again, so that the next build starts from it (layer cache) and `podman run $LOCAL_REF` works.
$PODMAN tag "$REMOTE_REF" "$LOCAL_REF"

# --- 8. pull as a new node would -----------------------------------------------------------------------------
# The pull above finds every layer already in this storage and fetches only the manifest and config. A
# cluster node starts empty: pull into an empty storage of its own, so every blob crosses the registry and
# is checked against its digest, then drop that storage. Once per image (the ID is remembered).
if [ "$(cat "$STATE/node-pulled.txt" 2>/dev/null)" != "$image_id" ]; then
  t0=$(date +%s)
  node=$STATE/node
  as_root rm -rf "$node"
  say "pulling $REMOTE_REF into an empty storage, as a new cluster node would..."
  $PODMAN --root "$REPO/$node/root" --runroot "$REPO/$node/run" --storage-driver overlay pull -q "$REMOTE_REF" \
    > "$STATE/node-pull.log" 2>&1 || { as_root rm -rf "$node"; cat "$STATE/node-pull.log" >&2; die "a fresh pull from $REGISTRY failed"; }
  node_id=$($PODMAN --root "$REPO/$node/root" --runroot "$REPO/$node/run" --storage-driver overlay image inspect --format '{{.Id}}' "$REMOTE_REF")
  $PODMAN --root "$REPO/$node/root" --runroot "$REPO/$node/run" --storage-driver overlay system reset -f > /dev/null 2>&1 || true
  as_root rm -rf "$node"
  [ "$node_id" = "$image_id" ] || die "the image a fresh node pulls ($node_id) is not the one built ($image_id)"
  echo "$image_id" > "$STATE/node-pulled.txt"
  say "a fresh node pulled the same image in $(since "$t0")"
fi
echo "$REMOTE_REF" > "$REF_FILE"
say "image: $REMOTE_REF (written to $REF_FILE)"
