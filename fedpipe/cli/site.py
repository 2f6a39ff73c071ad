"""`fedpipe site`: a site of a real federation (its own data, its own process): keygen, join, try."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import ConfigOpt, SetOpt, _guarded, _load, app
from fedpipe.errors import ConfigError
from fedpipe.federation import flower_env

site_app = typer.Typer(
    help="A site of a federation (engine.mode=federation): a Flower SuperNode running fedpipe's client side next to "
         "the site's own data, which never leaves it. `keygen` makes the site's key pair (its public key is registered "
         "at the SuperLink), `join` connects the site and trains whatever run the SuperLink sends, `try` runs a whole "
         "federation on this machine. docs/federation.md says how the parts fit.",
    no_args_is_help=True,
)
app.add_typer(site_app, name="site")

FLOWER_ENV = flower_env()  # FEDPIPE_FLOWER_ENV (the image: /opt/flower), else the checkout's .cache/flower-venv
FlowerEnvOpt = Annotated[Optional[Path], typer.Option("--flower-env", help="The Python environment holding Flower 1.42 "
                                                      "(scripts/flower-env.sh builds .cache/flower-venv; the image has /opt/flower); default: "
                                                      "$FEDPIPE_FLOWER_ENV, else .cache/flower-venv, else the flower-supernode on PATH.")]
PolicyOpt = Annotated[Optional[Path], typer.Option("--policy", help="The site's policy file (YAML, the site's own): the "
                                                 "methods, privacy, limits and releases it allows (docs/site-admin.md). "
                                                 "Default: the safe defaults `fedpipe site check` prints.")]


def _flower_bin(env: Optional[Path], program: str) -> str:
    """`program` from the Flower environment, or from PATH; a ConfigError saying how to get it."""
    for candidate in ([env / "bin" / program] if env else [FLOWER_ENV / "bin" / program]):
        if candidate.exists():
            return str(candidate)
    found = shutil.which(program)
    if found:
        return found
    raise ConfigError(f"{program} (Flower 1.42) was not found{f' in {env}/bin' if env else ''} or on PATH: build the Flower "
                      "environment with scripts/flower-env.sh (flwr pins web libraries that fedpipe's own environment needs newer), "
                      "or pass --flower-env")


@site_app.command("keygen")
@_guarded
def keygen(name: Annotated[str, typer.Argument(help="The site's name (file names only; e.g. hospital-a).")],
           out: Annotated[Path, typer.Option(help="Folder for NAME.key (private: stays at the site) and NAME.pub.")] = Path("."),
           ):
    """Make the site's authentication key pair (EC P-384, OpenSSH format, as Flower's SuperNode authentication takes).

    Send NAME.pub to the federation's operator, who registers it with `fedpipe federation register NAME.pub
    --superlink HOST:PORT --root-certificates ca.crt`; only registered keys may join. Keep NAME.key at the site
    (mode 600)."""
    from fedpipe.federation.certs import make_site_key

    out.mkdir(parents=True, exist_ok=True)
    private, public = make_site_key(out, name)
    typer.echo(f"wrote {private} (private: keep it here) and {public}")
    typer.echo(f"next: the operator runs `fedpipe federation register {public.name} --superlink HOST:PORT "
               f"--root-certificates ca.crt`; then `fedpipe site join --key {private} ...` here")


@site_app.command("join")
@_guarded
def join(data: Annotated[str, typer.Option(help="This site's own data: a folder or s3://bucket/prefix with its fedpipe-data.yaml "
                                                "(`fedpipe data init`), holding one client (this site).")],
         superlink: Annotated[str, typer.Option(help="The SuperLink's host:port (its TLS port).")],
         root_certificates: Annotated[Path, typer.Option(help="The CA certificate (PEM) the SuperLink's certificate is checked against.")],
         key: Annotated[Path, typer.Option(help="This site's private key (`fedpipe site keygen`); its public key must be registered.")],
         state: Annotated[Path, typer.Option(help="This site's folder: its prepared splits and the personal models it keeps "
                                                  "across rounds, phases and runs (never sent).")],
         opt_out: Annotated[bool, typer.Option("--opt-out", help="Train only this site's own models; upload nothing "
                                               "(methods with opt-out clients, e.g. the mixture of experts).")] = False,
         port: Annotated[int, typer.Option(help="This SuperNode's own Runtime API port on 127.0.0.1 (one per site on a machine).")] = 9094,
         image_size: Annotated[Optional[int], typer.Option(help="Check the images at this size (the run's data.image_size).")] = None,
         policy: PolicyOpt = None,
         flower_env: FlowerEnvOpt = None):
    """Join a federation as a site: check this site's data and policy, then serve the federation with fedpipe's own code.

    The site is one worker process (fedpipe's, in the Flower environment) and its Flower SuperNode, which it starts in
    process isolation: the worker answers every message with fedpipe's ClientApp, never with code a submitted run
    brings, and refuses, by name, any message its --policy does not allow, before it reads any data. Each run is
    trained here on this site's own files: the site splits them itself (by each sample's identity, as the simulation
    of all sites' files would), answers the census with its label counts, trains the rounds it is chosen for, keeps
    its personal models in --state, and sends only what the method uploads. Every message taken or refused is a line
    of --state/messages.jsonl (`fedpipe site check --state` sums it up). Stops with Ctrl-C; started again with the
    same key and --state, it rejoins with its state."""
    from fedpipe.federation.policy import SitePolicy
    from fedpipe.federation.tryout import site_args, supernode_options

    name, samples = _check_site(data, root_certificates, key, image_size)
    rules = SitePolicy.read(policy)
    why = rules.serves(superlink)
    if why:
        raise ConfigError(f"{why}: add it to the policy's federations ({policy}) or join another SuperLink")
    state.mkdir(parents=True, exist_ok=True)
    node = {"site-dir": str(state.resolve()), "data": data if "://" in data else str(Path(data).resolve()), "opt-out": opt_out}
    python = _flower_python(flower_env)
    args = site_args(python, supernode_options(superlink, root_certificates.resolve(), key.resolve(), node, port), state.resolve(),
                     port, superlink, policy.resolve() if policy else None, rules.name or key.stem)
    typer.echo(f"site {rules.name or name}: {samples} samples checked; joining {superlink} under "
               f"{'the policy ' + str(policy) if policy else 'the default policy'}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
    sys.stdout.flush()  # exec replaces this process: what it printed must be out first
    os.execve(python, args, env)  # the site process becomes the worker (signals, exit code and logs are its own)


def _flower_python(env: Optional[Path]) -> str:
    """The Flower environment's Python (next to its flower-supernode), which runs the site's worker."""
    return str(Path(_flower_bin(env, "flower-supernode")).parent / "python")


def _check_site(data: str, root_certificates: Path, key: Path, image_size: Optional[int]) -> tuple[str, int]:
    """The site's own files (one client, readable, valid), its CA certificate and its private key; returns the client's
    name and sample count. Nothing is sent anywhere."""
    from cryptography.hazmat.primitives import serialization

    from fedpipe.data.files import check_files

    for path, what in ((root_certificates, "--root-certificates"), (key, "--key")):
        if not path.is_file():
            raise ConfigError(f"{what} {path} does not exist")
    try:
        serialization.load_ssh_private_key(key.read_bytes()[:65536], password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--key {key} is not an unencrypted OpenSSH private key ({e}): make one with `fedpipe site keygen`") from None
    check = check_files(data, image_size)
    check.problems.raise_if_errors(check.source)
    if check.rows is not None and len(check.rows.client_names) != 1:
        names = check.rows.client_names
        raise ConfigError(f"{data} holds {len(names)} clients ({', '.join(names[:5])}): a site holds one client's data. "
                          "Give each client its own site (its own folder or table).")
    return (check.rows.client_names[0], int(check.rows.y.size)) if check.rows is not None else ("?", 0)


def _check_superlink(superlink: str, root_certificates: Path, timeout: float) -> str:
    """A TLS handshake with the SuperLink's fleet API, its certificate checked against the CA and its address (what
    the SuperNode's HTTPS client checks); returns the certificate's subject. Nothing but the handshake is sent."""
    import socket
    import ssl

    host, _, port = superlink.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--superlink {superlink!r} is not host:port")
    context = ssl.create_default_context(cafile=str(root_certificates))
    # what Flower 1.42's SuperNode offers (httpx, HTTP/1.1): the chart's nginx filter refuses a handshake offering h2 only
    context.set_alpn_protocols(["http/1.1"])
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=host.strip("[]")) as tls:
            subject = dict(item for rdn in tls.getpeercert().get("subject", ()) for item in rdn)
    except ssl.SSLCertVerificationError as e:
        raise ConfigError(f"the SuperLink at {superlink} answered, but its certificate does not check against {root_certificates}: "
                          f"{e.verify_message}. Use the federation's CA certificate, and the address the certificate names") from None
    except OSError as e:
        raise ConfigError(f"cannot reach the SuperLink at {superlink}: {e}. Is it running, is the address right, and does "
                          "the network (a NetworkPolicy, a firewall) let this site through?") from None
    return subject.get("commonName", "?")


@site_app.command("check")
@_guarded
def check(data: Annotated[str, typer.Option(help="This site's own data (as for `fedpipe site join`).")],
          superlink: Annotated[str, typer.Option(help="The SuperLink's host:port (its TLS port).")],
          root_certificates: Annotated[Path, typer.Option(help="The CA certificate (PEM) the SuperLink's certificate is checked against.")],
          key: Annotated[Path, typer.Option(help="This site's private key (read, never sent).")],
          image_size: Annotated[Optional[int], typer.Option(help="Check the images at this size (the run's data.image_size).")] = None,
          timeout: Annotated[float, typer.Option(help="Seconds to wait for the SuperLink.")] = 10.0,
          policy: PolicyOpt = None,
          state: Annotated[Optional[Path], typer.Option(help="This site's folder (as for join): sums up its log of the "
                                                              "messages it took and refused.")] = None):
    """Check that this site can join, without joining and without sending any of its data: its own files are one
    client's and valid, its key is a private key, its policy file is valid (printed rule by rule) and serves that
    SuperLink, and the SuperLink answers a TLS handshake with a certificate the CA signed for that address. With
    --state, the site's log of the messages it took or refused, per run. Exit 0 when all hold (the fedpipe-site
    chart's `helm test` runs this); otherwise one line says what is wrong and how to fix it."""
    from fedpipe.federation import site_log
    from fedpipe.federation.policy import SitePolicy

    rules = SitePolicy.read(policy)
    for line in rules.summary():
        typer.echo(f"policy     {line}")
    why = rules.serves(superlink)
    if why:
        raise ConfigError(f"{why}: add it to the policy's federations ({policy})")
    if state is not None:
        for line in site_log.summary(state):
            typer.echo(f"log        {line}")
    name, samples = _check_site(data, root_certificates, key, image_size)
    typer.echo(f"data       site {name}: {samples} samples in {data}, checked")
    typer.echo(f"key        {key}: an OpenSSH private key (its public key must be registered with the SuperLink)")
    subject = _check_superlink(superlink, root_certificates, timeout)
    typer.echo(f"superlink  {superlink}: TLS handshake done, certificate of {subject} checked against {root_certificates}")


@site_app.command("try")
@_guarded
def try_out(config: ConfigOpt = None, set: SetOpt = None,
            work: Annotated[Path, typer.Option(help="Folder for the certificates, the sites' folders, logs and the result.")] = Path("fedpipe-federation"),
            timeout: Annotated[float, typer.Option(help="Seconds to wait for the whole run.")] = 900,
            flower_env: FlowerEnvOpt = None):
    """Run a config as a federation on this machine: a SuperLink and one site process per client, TLS and site keys
    on, each site reading only its own folder; then stop everything it started.

    With data.dataset=files (image folders, one per client) each site gets a copy of its client's folder and makes its
    splits itself; with a bundled dataset the simulation's partition is exported, one folder of tensors per client.
    The global model, rounds.jsonl, census.json and the sites' evaluation land in WORK/out, the report (summary.json,
    sites.csv, plots, report.html) in WORK/report."""
    from fedpipe.federation.report import summary_lines, write_report
    from fedpipe.federation.tryout import run_tryout

    cfg = _load(config, set)
    run_tryout(cfg, work, flower_env or FLOWER_ENV, timeout)
    summary = write_report(work / "out", work / "report", f"{cfg.method.name}, a try-out federation on this machine")
    for line in summary_lines(summary):
        typer.echo(line)


@site_app.command("serve")
@_guarded
def serve(state: Annotated[Path, typer.Option(help="This site's folder (`fedpipe site join --state`).")],
          host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface, as in a pod).")] = "127.0.0.1",
          port: Annotated[int, typer.Option(min=1, max=65535, help="HTTP port.")] = 8080,
          max_request_bytes: Annotated[int, typer.Option(min=1024, help="A request body over this is answered 413.")] = 16 * 2**20,
          max_batch: Annotated[int, typer.Option(min=1, max=65536, help="Rows per request at most.")] = 1024,
          trust_unsigned: Annotated[bool, typer.Option("--trust-unsigned", help="Serve the site's line without signatures "
                                                       "(FEDPIPE_SIGNING_KEY unset): only if you trust everyone who can write --state.")] = False,
          register_only: Annotated[bool, typer.Option("--register-only", help="Export and register the models, then stop (no server).")] = False):
    """Serve this site's own models: its personalized model from the latest federated run it took part in (and the
    federation's global model), exported here and registered in a model line in --state/models/NAME, with the predictor
    `fedpipe models serve` runs (KServe's model server, open inference protocol v2 and v1). The personalized model never
    leaves the site. Ask for it with the client named as the site: {"parameters": {"client": "hospital-a"}, ...}."""
    from fedpipe.models.site_line import register_site_models

    line, record = register_site_models(state)
    typer.echo(f"site {record.clients[0]}: its models of run {record.run_id} are version {record.version} of {line.store.url(line.name)}",
               err=True)
    if register_only:
        return
    from fedpipe.errors import FedpipeError
    from fedpipe.serving.predictor import LinePredictor, ServeOptions

    predictor = LinePredictor(line, None, ServeOptions(max_batch=max_batch, trust_unsigned=trust_unsigned))
    try:
        from fedpipe.serving.kserve_model import serve as kserve
    except ImportError as e:
        raise FedpipeError(f"Serving needs the kserve package ({e}): pip install 'fedpipe[serve]'.") from None
    typer.echo(f"serving site {line.name} as /v2/models/{line.name}/infer on http://{host}:{port}", err=True)
    kserve(predictor, line.name, host, port, max_request_bytes)
