"""Kubeflow Hub (Kubeflow Model Registry) registration of a model line's promoted versions.

    status = sync_promoted(line, cfg.registry.kubeflow_hub)

Each promoted version becomes, through the `model-registry` client (kubeflow/model-registry's Python
client, REST API v1alpha3):

- a **RegisteredModel** named `kubeflow_hub.model` (default: the line's name), made once, owned by `author`;
- a **ModelVersion** named by the version number (`"3"`), with custom properties: the run, method, model,
  the gate's figures (metric, candidate, champion, the champion's version, the reason, promoted), the
  data snapshot (JSON text), the clients' count and the line's store URI;
- a **ModelArtifact** whose `uri` is the version's folder in the store (the serving spec, the global model
  and every client's model), format `fedpipe` / the serving spec's format version, so that KServe can
  name it as `model-registry://<model>/<version>`.

The outcome is kept beside the line (`models/<line>/hub/<version>.json`: registered or not, the ids, the
error): a registration that fails (registry down, refused, token missing) never undoes or blocks the
promotion; it is said in the step's log and outcome, and retried by the next publication of the line
(and by a rerun of the same publish step), which registers every promoted version still unregistered.
Registration is idempotent: a version the registry already holds with the same artifact URI counts as
registered; one that holds another URI is an error naming both (nothing is overwritten).

The token never enters a config, record or log: FEDPIPE_HUB_TOKEN, else the file FEDPIPE_HUB_TOKEN_FILE
names, else the pod's service-account token (what the registry's kube-rbac-proxy or Istio checks). It goes
only to the registry FEDPIPE_HUB_URL names (scheme, host and port), set beside the token by whoever holds
it: registry.kubeflow_hub.url is a config field, and a Kubeflow run's parameters can set it, so a URL from
the config alone never receives a token (as MLflow's credentials go only to MLFLOW_TRACKING_URI's server).
The decision is fedpipe's alone: the `model_registry` client, given no token, would read one of its own
($KF_PIPELINES_SA_TOKEN_PATH, else the pod's service-account token) and send it to whatever URL it was given,
so `connect` builds it with that fallback turned off (`_client_class`).
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from fedpipe.config import KubeflowHubConfig
from fedpipe.errors import CorruptArtifactError
from fedpipe.models.export import SPEC_FORMAT
from fedpipe.models.line import ModelLine, VersionRecord
from fedpipe.safe_load import read_store_json

log = logging.getLogger(__name__)

ENV_TOKEN = "FEDPIPE_HUB_TOKEN"  # noqa: S105 (a variable's name)
ENV_TOKEN_FILE = "FEDPIPE_HUB_TOKEN_FILE"  # noqa: S105
ENV_CA = "FEDPIPE_HUB_CA_FILE"  # a PEM bundle for an https registry signed by a private CA
ENV_URL = "FEDPIPE_HUB_URL"  # the registry the token belongs to: the only address it is sent to
SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")  # noqa: S105
MAX_TOKEN_BYTES = 64 * 1024
MAX_STATUS_BYTES = 64 * 1024
ATTEMPTS = 3  # tries per registration when the registry cannot be reached or answers 5xx
BACKOFF_S = 1.0
SYNC_VERSIONS = 50  # the newest promoted versions a publication checks
MODEL_FORMAT = "fedpipe"
MAX_TEXT = 4_000  # a custom property's text (the registry keeps MLMD string properties; a reason stays readable)


class HubError(Exception):
    """A registration the registry refused or could not take: what happened and how to fix it."""


def model_name(line: ModelLine, cfg: KubeflowHubConfig) -> str:
    return cfg.model or line.name


def properties(line: ModelLine, record: VersionRecord) -> dict[str, str | int | float | bool]:
    """The ModelVersion's custom properties: plain scalars (the registry's MetadataValue kinds)."""
    d = record.decision
    out: dict[str, str | int | float | bool] = {
        "fedpipe.line": line.name, "fedpipe.version": record.version, "fedpipe.run_id": record.run_id,
        "fedpipe.method": record.spec.method, "fedpipe.model": record.spec.model,
        "fedpipe.clients": len(record.clients), "fedpipe.store": line.store.url(line.keys.folder.rstrip("/")),
        "fedpipe.created": record.created,
    }
    for key in ("metric", "candidate", "champion", "champion_version", "promoted", "reason", "compared", "new_samples"):
        value = d.get(key)
        if isinstance(value, (bool, int, float, str)):
            out[f"fedpipe.gate.{key}"] = value[:MAX_TEXT] if isinstance(value, str) else value
    if record.data_snapshot is not None:
        out["fedpipe.data.snapshot"] = json.dumps(record.data_snapshot, sort_keys=True, default=str)[:MAX_TEXT]
    return {k: v for k, v in out.items() if v != ""}


def token() -> str | None:
    """The bearer token: FEDPIPE_HUB_TOKEN, the file FEDPIPE_HUB_TOKEN_FILE names, the pod's service-account
    token; None when there is none (an http registry without auth)."""
    if os.environ.get(ENV_TOKEN, "").strip():
        return os.environ[ENV_TOKEN].strip()
    named = os.environ.get(ENV_TOKEN_FILE, "").strip()
    path = Path(named) if named else SA_TOKEN
    try:
        with path.open("rb") as f:
            data = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as e:
        if named:
            raise HubError(f"{ENV_TOKEN_FILE}={named!r} cannot be read ({e.strerror}): point it at the token file "
                           f"(e.g. a mounted Secret's key) or set {ENV_TOKEN}.") from None
        return None
    if len(data) > MAX_TOKEN_BYTES:
        raise HubError(f"the token file {path} is over {MAX_TOKEN_BYTES} bytes: not a token.")
    return data.decode("utf-8", "replace").strip() or None


def _origin(url: str) -> tuple[str, str, int] | None:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return None
    return parts.scheme, parts.hostname.lower(), port


def is_trusted(url: str) -> bool:
    """Whether the token may go to `url`: it is FEDPIPE_HUB_URL's registry (same scheme, host and port)."""
    home = _origin(os.environ.get(ENV_URL, ""))
    return home is not None and _origin(url) == home


def _port_hint(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Server address protocol is")


def _client_class():
    """`model_registry.ModelRegistry` with its own token fallback turned off: given no token it sends none."""
    from model_registry import ModelRegistry

    if not callable(getattr(ModelRegistry, "_get_user_token", None)):  # the fallback moved: it cannot be turned off
        raise HubError("this `model-registry` client reads a token of its own in a way fedpipe cannot turn off, so it could "
                       "send the service-account token to any URL: install the version fedpipe pins (pip install 'fedpipe[hub]').")

    class OwnTokenOnly(ModelRegistry):
        @staticmethod
        def _get_user_token(user_token_envvar: str | None = None) -> str | None:
            return None  # the token is `connect`'s decision (`token`, `is_trusted`), never the client's

    return OwnTokenOnly


def connect(cfg: KubeflowHubConfig):
    """A `model_registry.ModelRegistry` for `cfg.url` (its constructor lists one page of models: a check
    that the address and the token work)."""
    try:
        client = _client_class()
    except ImportError:
        raise HubError("the `model-registry` client is not installed: pip install 'fedpipe[hub]' (fedpipe's images have it).") from None
    parts = urlsplit(cfg.url)
    secure = parts.scheme == "https"
    port = parts.port or (443 if secure else 80)
    address = f"{parts.scheme}://{parts.hostname}:{port}{parts.path.rstrip('/')}"
    explicit = bool(os.environ.get(ENV_TOKEN, "").strip() or os.environ.get(ENV_TOKEN_FILE, "").strip())
    if not is_trusted(cfg.url):
        if explicit:  # a token was given for some registry: never hand it to an address the config chose
            raise HubError(f"registry.kubeflow_hub.url {cfg.url!r} is not the registry {ENV_URL} names "
                           f"({os.environ.get(ENV_URL, '').strip() or 'unset'}), and the token is sent only there: set {ENV_URL} "
                           "beside the token to the registry's address (where the token's Secret is mounted), or correct the url.")
        bearer = None  # the pod's service-account token stays home too; an http registry without auth still works
    else:
        bearer = token()
    if secure and not bearer:
        raise HubError(f"registry.kubeflow_hub.url is https but no token may be sent to it: set {ENV_URL} to the registry's "
                       f"address and {ENV_TOKEN} (from a Secret), or {ENV_TOKEN_FILE}, or run where the service-account token "
                       f"is mounted ({SA_TOKEN}).")
    ca = os.environ.get(ENV_CA, "").strip() or None
    logging.getLogger("model-registry").addFilter(_port_hint)  # its hint misreads the registry's own port 8080 / 8443
    with warnings.catch_warnings():  # "User access token is missing": an http registry without auth, as decided above
        warnings.simplefilter("ignore", UserWarning)
        return client(address, port, author=cfg.author, is_secure=secure, user_token=bearer, custom_ca=ca)


def _register(client, name: str, line: ModelLine, record: VersionRecord, uri: str) -> dict:
    """The RegisteredModel, ModelVersion and ModelArtifact of `record`, made or found; their ids."""
    from model_registry.exceptions import StoreError

    version = str(record.version)
    existing = None
    if client.get_registered_model(name) is not None:
        existing = client.get_model_version(name, version)
    if existing is None:
        client.register_model(name, uri, version=version, model_format_name=MODEL_FORMAT,
                              model_format_version=SPEC_FORMAT.rsplit("/", 1)[-1],
                              version_description=f"fedpipe model line {line.name}, version {version} (run {record.run_id})",
                              metadata=properties(line, record))
    try:
        artifact = client.get_model_artifact(name, version)
    except StoreError as e:
        raise HubError(f"the registry lost {name} version {version} right after registering it: {e}") from None
    if artifact is None:
        raise HubError(f"the registry holds {name} version {version} without a model artifact (a registration cut "
                       f"short by someone else): delete or archive that version in Kubeflow Hub and publish again.")
    if artifact.uri != uri:
        raise HubError(f"the registry already holds {name} version {version} with the artifact URI {artifact.uri!r}, "
                       f"not this line's {uri!r} (two lines, or two stores, under one model name?): set "
                       f"registry.kubeflow_hub.model to a name of this line's own; nothing was overwritten.")
    mv = client.get_model_version(name, version)
    rm = client.get_registered_model(name)
    return {"registered_model_id": rm.id, "model_version_id": mv.id, "model_artifact_id": artifact.id}


def _transient(exc: BaseException) -> bool:
    """Worth another try: the registry could not be reached or answered 5xx (not a 4xx refusal)."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status >= 500
    return isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.startswith("aiohttp")


def _api_hint(exc: BaseException) -> str:
    """What a 404 on the registry's API root means: the client and the server speak different API versions."""
    if getattr(exc, "status", None) != 404 or "/api/model_registry/" not in str(exc):
        return ""
    from importlib.metadata import version
    return (f" (the registry does not serve the API path the installed model-registry client "
            f"{version('model-registry')} calls: fedpipe pins the client of the v0.3.x registries Kubeflow ships; "
            f"check that registry.kubeflow_hub.url names the registry's REST service, port 8080)")


def register_version(line: ModelLine, record: VersionRecord, cfg: KubeflowHubConfig) -> dict:
    """Register one version, with up to ATTEMPTS tries on a transient failure; never raises for what the
    registry says: returns the status that is kept beside the line (registered or not, and why)."""
    # the folder, ending in "/": KServe's storage initializer (v0.18.0 kserve_storage._download_s3) lists
    # objects by this prefix, so without the slash version 1 would also download versions 10-19
    name, uri = model_name(line, cfg), line.store.url(line.keys.version(record.version).rstrip("/")) + "/"
    status = {"registered": False, "url": cfg.url, "model": name, "version": str(record.version), "uri": uri,
              "storage_uri": f"model-registry://{name}/{record.version}",  # what an InferenceService names once registered
              "at": datetime.now(UTC).isoformat(timespec="seconds")}
    for attempt in range(1, ATTEMPTS + 1):
        status["attempts"] = attempt
        try:
            status.update(_register(connect(cfg), name, line, record, uri), registered=True)
            status.pop("error", None)
            log.info("Kubeflow Hub: %s version %s registered at %s (model-registry://%s/%s).", name, record.version, cfg.url,
                     name, record.version)
            return status
        except HubError as e:
            status["error"] = str(e)
            break
        except Exception as e:  # noqa: BLE001 (the client's errors: aiohttp, ApiException, StoreError, ValueError)
            status["error"] = f"{type(e).__name__}: {str(e)[:MAX_TEXT]}" + _api_hint(e)
            if not _transient(e) or attempt == ATTEMPTS:
                break
            time.sleep(BACKOFF_S * attempt)
    log.warning("Kubeflow Hub: %s version %s is promoted but not registered at %s (%s). The promotion stands; the next "
                "publication of line %r retries.", name, record.version, cfg.url, status["error"], line.name)
    return status


def recorded(line: ModelLine, version: int) -> dict | None:
    """The kept registration status of `version` (None: never tried)."""
    key = line.keys.hub(version)
    if not line.store.exists(key):
        return None
    try:
        status = read_store_json(line.store, key, "Kubeflow Hub status", MAX_STATUS_BYTES, CorruptArtifactError)
    except CorruptArtifactError:
        return None  # a damaged status is tried again, not trusted
    return status if isinstance(status, dict) else None


def sync_promoted(line: ModelLine, cfg: KubeflowHubConfig) -> list[dict]:
    """Register every promoted version of `line` (the newest SYNC_VERSIONS promotions) that is not registered
    at `cfg.url` yet; keep each outcome beside the line. [] when Kubeflow Hub is off."""
    if not cfg.url:
        return []
    promoted = sorted({int(e["version"]) for e in line.history()[-SYNC_VERSIONS:] if e.get("version")})
    out = []
    for version in promoted:
        before = recorded(line, version)
        if before and before.get("registered") and before.get("url") == cfg.url and before.get("model") == model_name(line, cfg):
            continue
        status = register_version(line, line.record(version), cfg)
        line.store.put_text(line.keys.hub(version), json.dumps(status, indent=2))
        out.append(status)
    return out
