"""`fedpipe federation`: the operator's side of a real federation: its CA and the SuperLink's certificate, the sites'
keys registered, rotated and listed (through Flower 1.42's `flwr supernode` commands), with a local ledger of which
site holds which node. docs/federation-keys.md is the walk-through."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import _guarded, app
from fedpipe.cli.site import FlowerEnvOpt, _check_superlink, _flower_bin
from fedpipe.errors import ConfigError

federation_app = typer.Typer(
    help="The operator's side of a federation (engine.mode=federation): `certs` makes the federation's CA and the "
         "SuperLink's TLS certificate (and Kubernetes Secrets for the charts), `superlink` starts the SuperLink with them "
         "(TLS, only registered sites), `register` lets a site's public key join, "
         "`rotate` replaces a site's key and retires its old node, `sites` lists the nodes the SuperLink knows. Sites make "
         "their own keys (`fedpipe site keygen`) and send only NAME.pub. A ledger file (--ledger) remembers which node "
         "each site holds. docs/federation-keys.md walks through it.",
    no_args_is_help=True,
)
app.add_typer(federation_app, name="federation")

CONNECTION = "fedpipe-operator"  # the connection's name in the private, temporary FLWR_HOME
LEDGER = Path("federation-sites.json")
_SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_MAX_LEDGER_BYTES = 4 * 2**20

SuperlinkOpt = Annotated[str, typer.Option(help="The SuperLink's Control API, host:port (TLS): the SuperLink's own port, or the "
                                                "main chart's control port (9091), reached from the operator's network; never "
                                                "the sites' filtered fleet port.")]
CaOpt = Annotated[Path, typer.Option(help="The federation's CA certificate (ca.crt from `fedpipe federation certs`); the "
                                          "SuperLink's certificate is checked against it, for that address.")]
LedgerOpt = Annotated[Path, typer.Option(help="The ledger: site name -> node id, key fingerprint, registered-at (JSON, rewritten "
                                              "atomically). Keep one per federation; `rotate` reads the old node from it.")]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds to wait for the SuperLink (the TLS check and each flwr call).")]


# --- certificates ----------------------------------------------------------------------------------------------


@federation_app.command("certs")
@_guarded
def certs(out: Annotated[Path, typer.Option(help="Folder for ca.crt, ca.key, server.crt, server.key (keys at mode 600).")],
          host: Annotated[list[str], typer.Option(help="A name the SuperLink's certificate must carry (repeatable): the DNS name "
                                                       "or IP the sites dial, the control address the operator dials, the chart's "
                                                       "Service names. 127.0.0.1 is always added (the SuperExec calls its own "
                                                       "SuperLink there).")],
          days: Annotated[int, typer.Option(min=1, max=3650, help="Days the server certificate lasts (never past the CA).")] = 365,
          ca_days: Annotated[int, typer.Option(min=1, max=36500, help="Days a new CA lasts (renew the server certificate "
                                                                      "within it; a new CA means every site needs its ca.crt).")] = 3650,
          renew_server: Annotated[bool, typer.Option("--renew-server", help="Keep the CA in --out and issue a new server "
                                                     "certificate and key signed by it (give every --host again): sites keep "
                                                     "their trust.")] = False,
          kubernetes_secret: Annotated[Optional[str], typer.Option(help="Also write OUT/NAME.secret.yaml, a kubernetes.io/tls "
                                                                        "Secret (tls.crt, tls.key, ca.crt) for the main chart's "
                                                                        "federation.tls.secretName, and OUT/ca.secret.yaml (ca.crt "
                                                                        "only) for the sites.")] = None,
          ca_secret: Annotated[str, typer.Option(help="Name of the Secret in ca.secret.yaml (the fedpipe-site chart's "
                                                      "superlink.caSecret.name).")] = "federation-ca"):
    """Make the federation's CA and the SuperLink's TLS certificate for --host names (and 127.0.0.1).

    Run once per federation; keep ca.key offline (it signs the SuperLink's certificates). Give every site ca.crt (the
    only file that leaves; `--root-certificates` of `fedpipe site join`). The SuperLink takes --ssl-ca-certfile ca.crt
    --ssl-certfile server.crt --ssl-keyfile server.key. An existing CA is never overwritten: `--renew-server` issues a
    new server certificate under it. Prints paths, fingerprints and dates only, never a key."""
    from fedpipe.federation.certs import cert_fingerprint, check_secret_name, make_federation_tls, write_secret_manifests

    if kubernetes_secret:  # refuse a bad name before anything is written
        check_secret_name(kubernetes_secret, "--kubernetes-secret")
        check_secret_name(ca_secret, "--ca-secret")
    tls = make_federation_tls(out, host, days, ca_days, renew_server)
    ca_state = "kept" if tls.renewed else "new"
    typer.echo(f"CA           {tls.ca_cert} ({ca_state}; give it to every site)  valid {_dates(tls.ca)}")
    typer.echo(f"             sha256 {cert_fingerprint(tls.ca)}")
    typer.echo(f"CA key       {tls.ca_key} (mode 600: keep it offline; it signs the SuperLink's certificates)")
    typer.echo(f"server cert  {tls.server_cert} for {', '.join(tls.hosts)}  valid {_dates(tls.server)}")
    typer.echo(f"             sha256 {cert_fingerprint(tls.server)}")
    typer.echo(f"server key   {tls.server_key} (mode 600: only the SuperLink reads it)")
    if tls.server.not_valid_after_utc < dt.datetime.now(dt.UTC) + dt.timedelta(days=days) - dt.timedelta(minutes=1):
        typer.echo(f"note: the server certificate ends with the CA, on {tls.server.not_valid_after_utc:%Y-%m-%d}")
    if kubernetes_secret:
        server_secret, ca_file = write_secret_manifests(tls, out, kubernetes_secret, ca_secret)
        typer.echo(f"secret       {server_secret} (mode 600, holds the server key): kubectl apply -n <namespace> -f it, "
                   f"then --set federation.tls.secretName={kubernetes_secret}")
        typer.echo(f"secret       {ca_file} (ca.crt only): each site applies it and sets superlink.caSecret.name={ca_secret}")
    if tls.renewed:
        stale = sorted(p.name for p in out.glob("*.secret.yaml") if p.name != "ca.secret.yaml" and not kubernetes_secret)
        if stale:
            typer.echo(f"note: {', '.join(stale)} still hold(s) the old server certificate: add --kubernetes-secret NAME to rewrite it")
        typer.echo("next: restart the SuperLink with the new server.crt and server.key; sites need nothing new")


def _dates(cert) -> str:
    return f"{cert.not_valid_before_utc:%Y-%m-%d} .. {cert.not_valid_after_utc:%Y-%m-%d}"


# --- the SuperLink -----------------------------------------------------------------------------------------------


@federation_app.command("superlink")
@_guarded
def superlink(certs: Annotated[Path, typer.Option(help="The folder `fedpipe federation certs --out` wrote: its ca.crt, "
                                                       "server.crt and server.key are the SuperLink's TLS files.")],
              host: Annotated[str, typer.Option(help="The address the SuperLink listens on: 0.0.0.0 for every interface, or one "
                                                     "interface's address.")] = "0.0.0.0",
              port: Annotated[int, typer.Option(min=1, max=65535, help="Its one HTTPS port: the sites' Fleet API and the operator's "
                                                                       "Control API. NAME:PORT, NAME a --host of the certificate, is "
                                                                       "what `fedpipe site join --superlink`, `fedpipe federation "
                                                                       "register --superlink` and federation.superlink dial.")] = 9093,
              flower_env: FlowerEnvOpt = None,
              control_token: Annotated[Optional[Path], typer.Option(help="The Control API's token file (made, mode 0600, when "
                                                                         "missing). Default: control.token in --certs. Who "
                                                                         "runs `fedpipe run` or `fedpipe federation register` "
                                                                         "against this SuperLink sets FEDPIPE_CONTROL_TOKEN_FILE "
                                                                         "to a copy of it.")] = None,
              store: Annotated[Optional[list[str]], typer.Option(help="A run store (a folder this machine shares with the "
                                                                      "submitters, or s3://bucket/prefix) whose runs this "
                                                                      "SuperLink's ServerApps serve; repeat it for more. "
                                                                      "None: every `fedpipe run` submission is refused.")] = None):
    """Start the federation's SuperLink (Flower 1.42's flower-superlink) the way fedpipe's federation needs it.

    TLS with the files of `fedpipe federation certs` (the sites check the SuperLink against ca.crt), SuperNode
    authentication (only site keys registered with `fedpipe federation register` may join), listening on
    --host:--port, installing nothing a run asks for (--disable-runtime-dependency-installation). The Flower
    environment is found as `fedpipe site join` finds it, and its bin is put on PATH (flower-superlink starts
    flower-superexec by name). This process becomes the SuperLink: it runs in the foreground, logs to this
    terminal, and stops with Ctrl-C. The Control API on the same port has no authentication of its own in Flower
    1.42; fedpipe's SuperLink refuses every Control API call without the token in --control-token
    (fedpipe.federation.control), and its ServerApps write only into the --store stores (fedpipe.federation.places),
    whatever a submitted run names. Example:

        fedpipe federation superlink --certs certs --host 0.0.0.0 --port 9093 --store s3://runs/fedpipe
    """
    from fedpipe.federation.control import superlink_command
    from fedpipe.federation.tryout import SUPEREXEC_ENV, superlink_args

    files = {name: certs / name for name in ("ca.crt", "server.crt", "server.key")}
    missing = [name for name, path in files.items() if not path.is_file()]
    if missing:
        raise ConfigError(f"--certs {certs} has no {', '.join(missing)}: make the federation's certificates with `fedpipe "
                          f"federation certs --out {certs} --host NAME` (NAME: each name the sites dial the SuperLink by)")
    program = _flower_bin(flower_env, "flower-superlink")
    args = superlink_args(program, *(files[n].resolve() for n in ("ca.crt", "server.crt", "server.key")), host, port)
    python = Path(program).parent / "python"
    command = [*superlink_command(python), *args[1:]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    env["PATH"] = os.pathsep.join([str(Path(program).parent), env.get("PATH", "")])
    env.update(SUPEREXEC_ENV)
    token, store = _guard(env, control_token or certs / "control.token", store or [])
    typer.echo(f"SuperLink on {host}:{port}: TLS with {files['server.crt']} (sites check it against {files['ca.crt']}), "
               f"only registered site keys join; the Control API only with the token in {token} (FEDPIPE_CONTROL_TOKEN_FILE "
               f"of `fedpipe run` and `fedpipe federation register`); runs of {', '.join(store) if store else 'no store (--store)'}; "
               f"{program}")
    sys.stdout.flush()  # exec replaces this process: what it printed must be out first
    os.execve(str(python), command, env)  # the process becomes the SuperLink (signals, exit code and logs are its own)


def _guard(env: dict[str, str], token: Path, store: list[str]) -> tuple[Path, list[str]]:
    """`env` of a guarded SuperLink: the Control API token file `token` (made 0600 when missing, then checked), the run
    stores its ServerApps serve (folders made absolute: places.store_place compares with them) and no local root.
    Returns (token file, stores)."""
    from fedpipe.federation.control import TOKEN_ENV, ControlTokenError, read_token, write_token
    from fedpipe.federation.places import ROOT_ENV, STORE_ENV

    token = token.resolve()
    try:
        if not token.exists():
            write_token(token)
        read_token(token)  # its length and mode, checked before the SuperLink starts
    except (ControlTokenError, OSError) as e:
        raise ConfigError(f"--control-token {token}: {e}") from None
    env[TOKEN_ENV] = str(token)
    env.pop(ROOT_ENV, None)  # a ServerApp of this SuperLink serves store runs only
    store = [one if "://" in one else str(Path(one).resolve()) for one in store]
    if store:
        env[STORE_ENV] = ",".join(store)
    else:
        env.pop(STORE_ENV, None)
    return token, store


# --- flwr against one SuperLink ----------------------------------------------------------------------------------


class Flower:
    """Flower's `flwr` CLI against one SuperLink, through a connection in a private temporary FLWR_HOME (never the
    user's), with `--format json`; each call's answer parsed, each refusal a ConfigError in plain words."""

    def __init__(self, flwr: str, home: Path, superlink: str, root_certificates: Path, timeout: float):
        self.flwr, self.home, self.superlink, self.timeout = flwr, home, superlink, timeout
        self.root_certificates = root_certificates

    def call(self, what: str, *args: str) -> dict:
        from fedpipe.federation.control import cli_command  # with FEDPIPE_CONTROL_TOKEN_FILE set, flwr sends its token

        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME", "FLWR_"))}
        env.update(FLWR_HOME=str(self.home), FLWR_TELEMETRY_ENABLED="0", COLUMNS="100000", NO_COLOR="1")
        try:
            r = subprocess.run([*cli_command(self.flwr, env), *args, CONNECTION, "--format", "json"], capture_output=True, text=True, env=env,
                               timeout=self.timeout + 30, cwd=self.home, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"Flower did not answer within {self.timeout + 30:.0f}s to {what} at {self.superlink}: is the "
                              "SuperLink overloaded, or is a proxy holding the connection? Try again, or raise --timeout") from None
        answer = _json_answer(r.stdout)
        if r.returncode == 0 and answer.get("success") is True:
            return answer
        said = answer.get("error-message") or (r.stderr.strip() or r.stdout.strip())[-1500:] or f"exit status {r.returncode}"
        raise ConfigError(f"Flower refused to {what} at {self.superlink}: {_plain(said)}")


def _json_answer(stdout: str) -> dict:
    """The JSON object `flwr ... --format json` printed (it may follow other lines); {} when there is none."""
    start = stdout.find("{")
    try:
        answer = json.loads(stdout[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _plain(message: str) -> str:
    """Flower's error message without its connection banner, its code moved to the end."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip() and not ln.startswith("Using SuperLink:")]
    text = " ".join(lines)
    m = re.match(r"\[code: (\d+)\]\s*(.*)", text)
    return f"{m.group(2)} (Flower error code {m.group(1)})" if m else text


@contextlib.contextmanager
def flower(flower_env: Optional[Path], superlink: str, root_certificates: Path, timeout: float) -> Iterator[Flower]:
    """`flwr` found (or how to get it), the SuperLink's TLS checked as `fedpipe site check` checks it, a private
    FLWR_HOME holding only the connection; removed afterwards."""
    from fedpipe.federation.tryout import write_connection

    flwr = _flower_bin(flower_env, "flwr")
    if not root_certificates.is_file():
        raise ConfigError(f"--root-certificates {root_certificates} does not exist: give the federation's ca.crt "
                          "(`fedpipe federation certs` wrote it)")
    try:
        _check_superlink(superlink, root_certificates, timeout)
    except ConfigError as e:
        raise ConfigError(f"the TLS check of the SuperLink at {superlink} failed (as `fedpipe site check` makes it): {e}") from None
    home = Path(tempfile.mkdtemp(prefix="fedpipe-flwr-home-"))  # mode 700
    try:
        write_connection(home, CONNECTION, superlink, root_certificates)
        yield Flower(flwr, home, superlink, root_certificates, timeout)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _register_key(fl: Flower, key, name: str) -> int:
    """Register `key` (checked already) under `name`; the node id Flower assigned. Flower reads a copy of the key
    written here, so what it registers is exactly what was checked and fingerprinted."""
    from cryptography.hazmat.primitives import serialization

    copy = fl.home / f"{name}.pub"
    copy.write_bytes(key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    answer = fl.call(f"register the key of site {name}", "supernode", "register", str(copy), "--name", name)
    try:
        return int(answer["node-id"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"Flower registered site {name} at {fl.superlink} but named no node id (it answered {answer}): "
                          "run `fedpipe federation sites` to see the node") from None


# --- the ledger --------------------------------------------------------------------------------------------------


def read_ledger(path: Path) -> dict:
    """{"sites": {name: {"node_id", "fingerprint", "registered_at", "superlink", "retired": [...]}}}; empty if absent."""
    if not path.exists():
        return {"sites": {}}
    with open(path, "rb") as f:
        data = f.read(_MAX_LEDGER_BYTES + 1)
    try:
        ledger = json.loads(data) if len(data) <= _MAX_LEDGER_BYTES else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        ledger = None
    if not isinstance(ledger, dict) or not isinstance(ledger.get("sites"), dict):
        raise ConfigError(f"the ledger {path} is not a fedpipe federation ledger (JSON with a \"sites\" object): give the "
                          "right --ledger, or move this file away")
    return ledger


def write_ledger(path: Path, ledger: dict) -> None:
    """The ledger written atomically: a temporary file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(ledger, f, indent=2, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _site_name(name: str) -> str:
    if not _SITE_NAME.fullmatch(name):
        raise ConfigError(f"site name {name!r}: use letters, digits, '.', '_' and '-' (at most 63), e.g. hospital-a; pass --name")
    return name


def _owner_of(ledger: dict, fingerprint: str) -> Optional[str]:
    return next((n for n, e in ledger["sites"].items() if e.get("fingerprint") == fingerprint), None)


# --- register, rotate, sites -------------------------------------------------------------------------------------


@federation_app.command("register")
@_guarded
def register(key: Annotated[Path, typer.Argument(help="The site's PUBLIC key, NAME.pub from `fedpipe site keygen` (OpenSSH, EC). "
                                                      "Never a private key: that one stays at the site.")],
             superlink: SuperlinkOpt, root_certificates: CaOpt,
             name: Annotated[Optional[str], typer.Option(help="The site's name in the ledger (and Flower's node name); "
                                                             "default: the key file's name without .pub.")] = None,
             ledger: LedgerOpt = LEDGER, timeout: TimeoutOpt = 20.0, flower_env: FlowerEnvOpt = None):
    """Let a site join: register its public key with the SuperLink and record its node id in the ledger.

    Runs Flower's `flwr supernode register` (through a private, temporary FLWR_HOME). The SuperLink runs with --enable-supernode-auth, so only registered keys activate. Prints the node id and the key's
    SHA-256 fingerprint (as `ssh-keygen -lf KEY` prints it: compare it with the site's over another channel). A site
    that is already in the ledger changes its key with `fedpipe federation rotate`."""
    from fedpipe.federation.certs import load_site_public_key, ssh_fingerprint

    public = load_site_public_key(key)
    fingerprint = ssh_fingerprint(public)
    name = _site_name(name or (key.name[:-4] if key.name.endswith(".pub") else key.stem))
    book = read_ledger(ledger)
    if name in book["sites"]:
        raise ConfigError(f"site {name} is already registered as node {book['sites'][name]['node_id']} (ledger {ledger}): to "
                          f"give it a new key run `fedpipe federation rotate {name} NEW.pub ...`; for another site pass --name")
    if owner := _owner_of(book, fingerprint):
        raise ConfigError(f"this key ({fingerprint}) is already registered for site {owner} (ledger {ledger}): each site "
                          "needs its own key pair (`fedpipe site keygen` at that site)")
    with flower(flower_env, superlink, root_certificates, timeout) as fl:
        node_id = _register_key(fl, public, name)
    book["sites"][name] = {"node_id": node_id, "fingerprint": fingerprint, "registered_at": _now(), "superlink": superlink,
                           "retired": []}
    write_ledger(ledger, book)
    typer.echo(f"site {name}: registered as node {node_id} at {superlink}; key {fingerprint}; ledger {ledger}")
    typer.echo(f"next: the site runs `fedpipe site join --key {name}.key --superlink <fleet address> --root-certificates "
               "ca.crt ...` (the fedpipe-site chart: its siteKey Secret)")


@federation_app.command("rotate")
@_guarded
def rotate(site: Annotated[str, typer.Argument(help="The site's name in the ledger.")],
           key: Annotated[Path, typer.Argument(help="The site's NEW public key (NAME.pub of a new `fedpipe site keygen`).")],
           superlink: SuperlinkOpt, root_certificates: CaOpt, ledger: LedgerOpt = LEDGER, timeout: TimeoutOpt = 20.0,
           flower_env: FlowerEnvOpt = None):
    """Replace a site's key: register the new public key, then unregister the site's old node (from the ledger).

    If the new key cannot be registered, nothing is unregistered: the site keeps its old node. If the old node cannot be
    unregistered, the new key stays registered and the message says what to run to finish (this same command again).
    The site switches to its new private key (its key Secret) and restarts: it activates as the new node; the old key
    can no longer activate."""
    from fedpipe.federation.certs import load_site_public_key, ssh_fingerprint

    public = load_site_public_key(key)
    fingerprint = ssh_fingerprint(public)
    book = read_ledger(ledger)
    entry = book["sites"].get(site)
    if entry is None:
        known = ", ".join(sorted(book["sites"])) or "none"
        raise ConfigError(f"site {site} is not in the ledger {ledger} (sites there: {known}): register it first with "
                          f"`fedpipe federation register {key} --name {site} ...`, or give the right --ledger")
    pending = [r for r in entry.get("retired", []) if not r.get("unregistered_at")]
    if entry["fingerprint"] == fingerprint and not pending:
        raise ConfigError(f"{key} ({fingerprint}) is already site {site}'s key (node {entry['node_id']}): rotate to a new key "
                          "pair that the site made with `fedpipe site keygen`")
    if entry["fingerprint"] != fingerprint and (owner := _owner_of(book, fingerprint)):
        raise ConfigError(f"this key ({fingerprint}) is registered for site {owner}: each site needs its own key pair")
    with flower(flower_env, superlink, root_certificates, timeout) as fl:
        if entry["fingerprint"] != fingerprint:  # else: a rotation whose unregistration failed, finished now
            node_id = _register_key(fl, public, site)
            pending.append({"node_id": entry["node_id"], "fingerprint": entry["fingerprint"],
                            "registered_at": entry["registered_at"], "replaced_at": _now()})
            entry["retired"] = [*[r for r in entry.get("retired", []) if r.get("unregistered_at")], *pending]
            entry.update(node_id=node_id, fingerprint=fingerprint, registered_at=_now(), superlink=superlink)
            write_ledger(ledger, book)  # the new node is recorded before the old one goes
            typer.echo(f"site {site}: new key {fingerprint} registered as node {node_id}")
        _retire(fl, site, entry, pending, book, ledger, key)
    typer.echo(f"next: the site switches to its new private key and restarts (`fedpipe site join --key ...`, or the new key "
               f"in its siteKey Secret, then `kubectl rollout restart`); it activates as node {entry['node_id']}")


def _retire(fl: Flower, site: str, entry: dict, pending: list[dict], book: dict, ledger: Path, key: Path) -> None:
    """Unregister each of the site's replaced nodes not yet unregistered; the ledger records each one that goes."""
    for old in pending:
        try:
            fl.call(f"unregister node {old['node_id']} (site {site}'s old key)", "supernode", "unregister", str(old["node_id"]))
        except ConfigError as e:
            if "Node ID not found" in str(e):  # already gone (unregistered by hand, or a SuperLink that forgot its nodes)
                old["unregistered_at"] = _now()
                write_ledger(ledger, book)
                typer.echo(f"site {site}: old node {old['node_id']} is not known to the SuperLink any more: nothing to unregister")
                continue
            raise ConfigError(f"{e}. The new key of site {site} IS registered (node {entry['node_id']}, ledger {ledger} "
                              f"updated), but its old node {old['node_id']} can still activate with the old key. To finish, "
                              f"run again: fedpipe federation rotate {site} {key} --superlink {fl.superlink} "
                              f"--root-certificates {fl.root_certificates} --ledger {ledger} (it only unregisters the old node)") from None
        old["unregistered_at"] = _now()
        write_ledger(ledger, book)
        typer.echo(f"site {site}: old node {old['node_id']} (key {old['fingerprint']}) unregistered")


@federation_app.command("sites")
@_guarded
def sites(superlink: SuperlinkOpt, root_certificates: CaOpt, ledger: LedgerOpt = LEDGER, timeout: TimeoutOpt = 20.0,
          all_nodes: Annotated[bool, typer.Option("--all", help="Also list unregistered nodes (retired keys).")] = False,
          flower_env: FlowerEnvOpt = None):
    """List the nodes the SuperLink knows, with the ledger's site names.

    Flower's `flwr supernode ls` as a table: node id, status (registered: never connected yet; online; offline), the
    ledger's site (or "NAME (old key)" for a retired node), and when the status last changed. A ledger site the SuperLink does not know is named below the table (a SuperLink without --database forgets its
    nodes when it restarts: register the site again)."""
    book = read_ledger(ledger)
    with flower(flower_env, superlink, root_certificates, timeout) as fl:
        nodes = fl.call("list the nodes", "supernode", "ls").get("nodes") or []
    names = {str(e["node_id"]): n for n, e in book["sites"].items()}
    names.update({str(r["node_id"]): f"{n} (old key)" for n, e in book["sites"].items() for r in e.get("retired", [])})
    rows = [(str(n.get("node-id")), str(n.get("status")), names.get(str(n.get("node-id")), "-"), _since(n))
            for n in nodes if all_nodes or n.get("status") not in ("unregistered", "deleted")]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(("NODE ID", "STATUS", "SITE", "SINCE"))] if rows else []
    if not rows:
        typer.echo(f"the SuperLink at {superlink} knows no {'' if all_nodes else 'registered '}node")
    for row in [("NODE ID", "STATUS", "SITE", "SINCE"), *rows] if rows else []:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    seen = {str(n.get("node-id")) for n in nodes}
    for name, entry in sorted(book["sites"].items()):
        if str(entry["node_id"]) not in seen:
            typer.echo(f"site {name} (ledger: node {entry['node_id']}) is not known to the SuperLink: register it again")


def _since(node: dict) -> str:
    """When the node's status last changed, as Flower gives it: online since, offline since, registered at."""
    key = {"online": "online-at", "offline": "offline-at", "unregistered": "deleted-at"}.get(node.get("status"), "created-at")
    value = node.get(key)
    return str(value) if value and value != "N/A" else "-"
