"""One machine try-out: a SuperLink and N site processes on 127.0.0.1, TLS and SuperNode authentication on,
a fedpipe run submitted to them, and everything this started stopped at the end.

Flower 1.42 commands used (all from the environment scripts/flower-env.sh builds):
- `flower-superlink --ssl-ca-certfile CA --ssl-certfile CRT --ssl-keyfile KEY --enable-supernode-auth
  --host 127.0.0.1 --port P --disable-runtime-dependency-installation`: one HTTPS port serves the Fleet,
  Control and Runtime APIs (flwr/superlink/cli/flower_superlink.py); `--enable-supernode-auth` requires TLS
  and turns off self-registration through the Fleet API (flwr/superlink/servicer/fleet/fleet_handlers.py
  `register_node` raises FLEET_SUPERNODE_REGISTRATION_DISABLED), so only keys registered through the
  Control API can activate. It runs through `python -m fedpipe.federation.control superlink --`, which refuses every
  Control API call without the try-out's token; the `flwr` calls below run through `... control flwr`, which sends it.
- `flwr supernode register KEY.pub CONNECTION` (flwr/cli/supernode/register.py): registers a site's public
  key; CONNECTION is a [superlink.NAME] entry (address, root-certificates) of $FLWR_HOME/config.toml
  (flwr/cli/flower_config.py).
- `flower-supernode --superlink 127.0.0.1:P --root-certificates CA --auth-supernode-private-key KEY
  --node-config 'site-dir="..."' --port Q` (flwr/supernode/cli/flower_supernode.py): Q is the SuperNode's own
  Runtime API port (one per site on one machine).
- `flwr run APP_DIR CONNECTION --run-config ...` (flwr/cli/run/run.py): builds the FAB from APP_DIR's
  pyproject.toml and starts the run through the Control API.

Usage (from .venv, which prepares the sites; the Flower processes run in the Flower environment):
    python -m fedpipe.federation.tryout -c examples/fedavg_mnist5k.yaml --set partition.num_clients=4 --work /tmp/fl
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fedpipe.federation import flower_env
from fedpipe.federation.app import pyproject
from fedpipe.federation.certs import make_site_key, make_tls
from fedpipe.federation.control import TOKEN_ENV, cli_command, make_token, superlink_command
from fedpipe.federation.places import ROOT_ENV, STORE_ENV

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ENV = flower_env()  # FEDPIPE_FLOWER_ENV, else .cache/flower-venv
CONNECTION = "fedpipe-tryout"



def node_config_arg(entries: dict) -> str:
    """Flower's --node-config string (flwr/common/config.py `parse_config_args`: space-separated key=value, values as
    TOML: strings double-quoted, booleans bare)."""
    parts = []
    for k, v in entries.items():
        if isinstance(v, bool):
            parts.append(f"{k}={'true' if v else 'false'}")
        else:
            text = str(v)
            if '"' in text or "\\" in text or "\n" in text:
                raise ValueError(f"node config {k}={text!r}: a path or URL for a site may not hold a quote, a backslash or a newline")
            parts.append(f'{k}="{text}"')
    return " ".join(parts)


SUPEREXEC_ENV = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}  # the SuperLink's SuperExec starts a ServerApp within 0.1 s, not 1


def superlink_args(superlink: str | Path, ca_cert: str | Path, server_cert: str | Path, server_key: str | Path,
                   host: str, port: int) -> list[str]:
    """The command of a federation's SuperLink (`superlink`: the Flower environment's flower-superlink): TLS with the
    federation's CA and the SuperLink's certificate and key, SuperNode authentication (only site keys registered
    through the Control API may join), listening on `host`:`port` (one HTTPS port for the Fleet, Control and Runtime
    APIs), and nothing a run asks for installed. Run it with the Flower environment's bin on PATH (it starts
    `flower-superexec` by name) and SUPEREXEC_ENV in its environment."""
    return [str(superlink), "--ssl-ca-certfile", str(ca_cert), "--ssl-certfile", str(server_cert), "--ssl-keyfile", str(server_key),
            "--enable-supernode-auth", "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]


def supernode_options(superlink: str, ca_cert: str | Path, private_key: str | Path, node_config: dict,
                      port: int, max_retries: int | None = None) -> list[str]:
    """The `flower-supernode` options of one site: TLS against `ca_cert`, authenticated by its `private_key`, its folder
    (and its own files) in its node config, `port` its own Runtime API port on 127.0.0.1, which its worker alone
    talks to (flwr/supernode/cli/flower_supernode.py; the worker adds the process isolation)."""
    args = ["--superlink", superlink, "--root-certificates", str(ca_cert), "--auth-supernode-private-key",
            str(private_key), "--node-config", node_config_arg(node_config), "--host", "127.0.0.1", "--port", str(port)]
    if max_retries is not None:
        args += ["--max-retries", str(max_retries)]
    return args


def site_args(python: str | Path, supernode: list[str], site_dir: str | Path, runtime_port: int, superlink: str,
              policy: str | Path | None = None, name: str = "") -> list[str]:
    """The command of one site: fedpipe's warm worker (`fedpipe.federation.worker`, run by the Flower environment's
    `python`), which starts the SuperNode with the options `supernode` (`supernode_options`) in process isolation as its
    child and answers it with fedpipe's own ClientApp under the site's `policy` file (None: the defaults)."""
    args = [str(python), "-m", "fedpipe.federation.worker", "--site-dir", str(site_dir), "--runtime-port", str(runtime_port),
            "--superlink", superlink, "--name", name]
    if policy is not None:
        args += ["--policy", str(policy)]
    return [*args, "--", *supernode]


def write_connection(home: Path, name: str, address: str, ca_cert: str | Path) -> None:
    """The `flwr` CLI's connection `name` to the SuperLink at `address`, TLS against `ca_cert`, in $FLWR_HOME/config.toml
    (flwr/cli/flower_config.py)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n'
                                      f'root-certificates = "{Path(ca_cert).resolve()}"\n')


def submit_app(flwr: str | Path, environ: dict[str, str], app: Path, connection: str, spec_file: Path | None, out: Path | None,
               timeout: float = 300, round_timeout: float = 0, rejoin_wait: float = 0, store: str = "", prefix: str = "",
               stop_after: str = "") -> int | None:
    """`flwr run` of fedpipe's app (its pyproject written to `app`) through `connection`; returns once the SuperLink
    has accepted the run. The ServerApp reads `spec_file` and writes to `out`, paths on the SuperLink's machine, or,
    with `store`, meets the submitter in the run's store under `prefix` (`fedpipe.federation.outputs`); `stop_after`:
    the stage it stops after (`server_app.stages`; empty: the whole run). Returns the run's id, as Flower gave it."""
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(pyproject({
        "spec-file": str(Path(spec_file).resolve()) if spec_file else "", "out-dir": str(Path(out).resolve()) if out else "",
        "store": store, "prefix": prefix, "stop-after": stop_after, "timeout": float(timeout),
        "round-timeout": float(round_timeout), "rejoin-wait": float(rejoin_wait)}))
    # with a Control API token in `environ` (TOKEN_ENV), flwr runs through fedpipe.federation.control, which sends it
    r = subprocess.run([*cli_command(flwr, environ), "run", str(app), connection, "--format", "json"], capture_output=True,
                       text=True, env=environ, timeout=120, cwd=app.parent)
    said = r.stdout[r.stdout.find("{"):] if "{" in r.stdout else ""
    try:  # `flwr run --format json` exits 0 also when the SuperLink refused the run: its JSON says so
        answer = json.loads(said) if said else {}
    except ValueError:
        answer = {}
    refused = isinstance(answer, dict) and answer.get("success") is False
    if r.returncode != 0 or refused:
        hint = (f"\nthe SuperLink's Control API refused a call without its token: set {TOKEN_ENV} to the token file "
                "(docs/security.md, 'The Control API')") if "403" in r.stdout + r.stderr and not environ.get(TOKEN_ENV) else ""
        raise RuntimeError(f"flwr run failed ({r.returncode}):\n{r.stdout}\n{r.stderr}{hint}")
    run_id = answer.get("run-id") if isinstance(answer, dict) else None
    return int(run_id) if isinstance(run_id, (int, str)) and str(run_id).isdigit() else None


def wait_result(out: Path, timeout: float, gone=lambda: None, log=lambda: "") -> dict:
    """The ServerApp's result.json in `out` once written; RuntimeError with its error.json when it failed, or when
    `gone()` says why it never will (the SuperLink exited); TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (out / "result.json").exists():
            return json.loads((out / "result.json").read_text())
        if (out / "error.json").exists():
            raise RuntimeError(f"the ServerApp failed: {(out / 'error.json').read_text()}\n{log()}")
        why = gone()
        if why:
            raise RuntimeError(f"{why}:\n{log()}")
        time.sleep(0.5)
    raise TimeoutError(f"no result in {out} within {timeout:.0f}s\n{log()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackFederation:
    """Start with `start()` (or `with`), add sites with `start_site`, submit with `run`, and `stop()`: every
    process this started (each in its own process group, with its children) is ended, and only those. The Control API
    is the try-out's alone: a fresh token in `work`/control (`fedpipe.federation.control`, which says why not a Unix
    socket), sent by this object's `flwr` calls only; the ServerApp uses `server_root` (default `work`) and
    `server_store` only (`fedpipe.federation.places`), whatever a run config names."""

    def __init__(self, work: str | Path, env: str | Path = DEFAULT_ENV, server_root: str | Path | None = None,
                 server_store: str = ""):
        self.work, self.env = Path(work), Path(env)
        self.server_root, self.server_store = Path(server_root or work), server_store  # FEDPIPE_SERVER_ROOT, _STORE
        self.token: Path | None = None  # the Control API token, once started
        self.bin = self.env / "bin"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.site_args: dict[str, tuple[list[str], dict[str, str]]] = {}  # to restart a site as it was
        self.port = free_port()
        self.home = self.work / "flwr-home"
        self.certs = self.work / "certs"

    # --- environment -----------------------------------------------------------------------------
    def _environ(self, extra: dict[str, str] | None = None, control: bool = True) -> dict[str, str]:
        """Its processes' environment; the Control API token only with `control` (the SuperLink, its `flwr` calls)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
        env.pop("FEDPIPE_TEST_FAULT_INJECTOR", None)  # only a site started with it (start_site(env=...)) injects faults
        env.pop(TOKEN_ENV, None)
        if control and self.token is not None:
            env[TOKEN_ENV] = str(self.token)
        env["PATH"] = f"{self.bin}:{env.get('PATH', '')}"
        env["FLWR_HOME"] = str(self.home)
        env["PYTHONPATH"] = str(ROOT)
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
        env["FLWR_TELEMETRY_ENABLED"] = "0"
        env.update(SUPEREXEC_ENV)
        env.update(extra or {})
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, control: bool = False) -> subprocess.Popen:
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.logs[name] = log
        p = subprocess.Popen(["nice", "-n", "10", *args], stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=self._environ(env, control),
                             start_new_session=True, cwd=self.work)
        self.procs[name] = p
        return p

    def _cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = self._environ()
        return subprocess.run([*cli_command(self.bin / "flwr", env), *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=self.work)

    def log_of(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if name in self.logs and self.logs[name].exists() else ""

    # --- the SuperLink -------------------------------------------------------------------------------
    def start(self) -> LoopbackFederation:
        self.work.mkdir(parents=True, exist_ok=True)
        self.tls = make_tls(self.certs)
        self.token = make_token(self.work / "control")
        write_connection(self.home, CONNECTION, f"127.0.0.1:{self.port}", self.tls["ca_cert"])
        args = superlink_args("", self.tls["ca_cert"], self.tls["server_cert"], self.tls["server_key"], "127.0.0.1", self.port)[1:]
        self._spawn("superlink", [*superlink_command(self.bin / "python"), *args],  # Flower's flower-superlink, guarded
                    {ROOT_ENV: str(self.server_root.resolve()), STORE_ENV: self.server_store}, control=True)
        self._wait_port(self.port, "superlink")
        return self

    def _wait_port(self, port: int, name: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited ({self.procs[name].returncode}):\n{self.log_of(name)[-3000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"{name} did not listen on {port} within {timeout}s:\n{self.log_of(name)[-3000:]}")

    # --- sites ---------------------------------------------------------------------------------------
    def register(self, public_key: Path) -> None:
        r = self._cli("supernode", "register", str(public_key), CONNECTION)
        if r.returncode != 0:
            raise RuntimeError(f"flwr supernode register {public_key.name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")

    def start_site(self, folder: str | Path, name: str | None = None, register: bool = True, max_retries: int | None = None,
                   env: dict[str, str] | None = None, node_config: dict | None = None, policy: str | Path | None = None,
                   worker: bool = True) -> str:
        """A site for the folder `folder` (its warm worker and its SuperNode, `site_args`), with a fresh key pair
        (registered unless `register=False`); `env` adds environment variables to the site's processes (the tests' fault
        injector); `node_config` adds node config entries (a site with its own files: `data`, `opt-out`); `policy`: the
        site's policy file (None: the defaults). `worker=False`: Flower's own SuperNode in its default subprocess isolation
        instead, which runs whatever ClientApp a run's FAB names (benchmarks/federation.py runs Flower's own app on it)."""
        folder = Path(folder)
        name = name or folder.name
        for old in (self.certs / "sites" / f"{name}.key", self.certs / "sites" / f"{name}.pub"):
            old.unlink(missing_ok=True)  # the try-out's own keys of an earlier try-out: each start makes a fresh pair
        private, public = make_site_key(self.certs / "sites", name)
        if register:
            self.register(public)
        node = {"site-dir": str(folder.resolve()), **(node_config or {})}
        port = free_port()
        supernode = supernode_options(f"127.0.0.1:{self.port}", self.tls["ca_cert"], private, node, port, max_retries)
        args = (site_args(self.bin / "python", supernode, folder.resolve(), port, f"127.0.0.1:{self.port}", policy, name) if worker
                else [str(self.bin / "flower-supernode"), *supernode])
        self.site_args[name] = (args, dict(env or {}))
        self._spawn(name, args, env)
        return name

    def kill_site(self, name: str) -> None:
        kill_site(self, name)

    def restart_site(self, name: str, env: dict[str, str] | None = None, timeout: float = 150) -> float:
        return restart_site(self, name, env, timeout)

    # --- a run ---------------------------------------------------------------------------------------
    def submit(self, spec_file: Path, out: Path, timeout: float = 300, round_timeout: float = 0, rejoin_wait: float = 0) -> None:
        """Submit fedpipe's app for `spec_file` (`round_timeout` 0: `timeout`; `rejoin_wait`: how long a round
        waits for a site that is not connected, see server_app.serve) and return at once."""
        submit_app(self.bin / "flwr", self._environ(), self.work / "fedpipeapp", CONNECTION, spec_file, out, timeout,
                   round_timeout, rejoin_wait)

    def run(self, spec_file: Path, out: Path, timeout: float = 300, round_timeout: float = 0, rejoin_wait: float = 0) -> dict:
        """Submit fedpipe's app for `spec_file`, wait for the ServerApp's result.json (or error.json)."""
        self.submit(spec_file, out, timeout, round_timeout, rejoin_wait)
        return self.wait(out, timeout)

    def wait(self, out: Path, timeout: float = 300) -> dict:
        """The ServerApp's result.json, once written (RuntimeError with its error.json if it failed)."""
        superlink = self.procs["superlink"]
        return wait_result(out, timeout, lambda: None if superlink.poll() is None else "the SuperLink exited",
                           lambda: self.log_of("superlink")[-3000:])

    # --- stopping ------------------------------------------------------------------------------------
    def stop(self, name: str | None = None) -> None:
        for n in [name] if name else list(self.procs)[::-1]:
            p = self.procs.pop(n, None)
            if p is None or p.poll() is not None:
                continue
            try:
                os.killpg(p.pid, signal.SIGTERM)  # its own session: the process and the children it spawned
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            except ProcessLookupError:
                pass

    def __enter__(self) -> LoopbackFederation:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def kill_site(fed: LoopbackFederation, name: str) -> None:
    """SIGKILL a site's process (its warm worker: a crash, no goodbye to the SuperLink). Its SuperNode dies with it
    (PR_SET_PDEATHSIG, `fedpipe.federation.worker`); whatever of the site's process group is still alive 10 s later
    (a Flower SuperNode started with `worker=False`) is killed too."""
    p = fed.procs.pop(name)
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)  # anyone left in the site's group?
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live descendant of `pid`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append((child, cmdlines.get(child, "")))
            todo.append(child)
    return found


def kill_serverapp(fed: LoopbackFederation) -> list[int]:
    """SIGKILL the running ServerApp process(es) (a crash of the phase task's side; the SuperLink and the sites stay up).

    Flower 1.42 runs each run's ServerApp as a `flwr-serverapp` process that the SuperLink's SuperExec
    (`flower-superexec`, started by `flower-superlink` in its own session, flwr/superlink/cli/flower_superlink.py)
    launches (flwr/supercore/superexec/executor/subprocess_executor.py): a descendant of the SuperLink this started.
    Returns the pids killed."""
    killed = []
    for pid, cmd in descendants(fed.procs["superlink"].pid):
        if "flwr-serverapp" in cmd:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def restart_site(fed: LoopbackFederation, name: str, env: dict[str, str] | None = None, timeout: float = 150) -> float:
    """Start a killed site again with its key and folder (as a supervisor such as Kubernetes would), retrying
    until the SuperLink lets it activate: after a crash its node counts as online until it misses its
    heartbeats (Flower 1.42: 2 x 30 s), and activation is refused until then. Returns the seconds it took."""
    args, old_env = fed.site_args[name]
    env = old_env if env is None else env
    t0 = deadline = time.monotonic()
    deadline += timeout
    while time.monotonic() < deadline:
        mark = fed.logs[name].stat().st_size if name in fed.logs and fed.logs[name].exists() else 0
        p = fed._spawn(name, args, env)
        while p.poll() is None and "SuperNode ID:" not in fed.log_of(name)[mark:]:
            time.sleep(0.5)  # activated (it logs its node id) or refused (it exits, Flower's exit code 305)
        if p.poll() is None:
            return time.monotonic() - t0
        fed.procs.pop(name, None)
        tail = fed.log_of(name)[mark:]
        if "Failed to activate" not in tail:
            raise RuntimeError(f"site {name} exited ({p.returncode}) on restart:\n{tail[-3000:]}")
        time.sleep(3)
    raise TimeoutError(f"site {name} could not rejoin within {timeout:.0f}s:\n{fed.log_of(name)[-3000:]}")


def prepare(cfg, work: Path) -> tuple[Path, list[Path]]:
    """In .venv: split the dataset the way the simulation does (`fedpipe.run.run.federated_data` of the run's
    partition) and write one folder per site plus the spec; returns (spec file, site folders)."""
    import torch

    from fedpipe.data.partition import make_partition
    from fedpipe.federation.sites import export_sites
    from fedpipe.federation.spec import FederationSpec
    from fedpipe.run.run import Run, federated_data

    run = Run(cfg)
    partition = make_partition(run.bundle, cfg.partition, cfg.run.seed)
    data = federated_data(run, partition, torch.device("cpu"))
    folders = export_sites(data, work / "sites")
    spec = FederationSpec.from_run_config(cfg, data.input_shape, data.num_classes, len(folders))
    spec_file = work / "spec.json"
    spec_file.write_text(spec.to_json())
    return spec_file, folders


def prepare_own_files(cfg, work: Path) -> tuple[Path, dict[str, Path]]:
    """In .venv, for a run on a user's own image folders (data.dataset=files, data.source=ROOT holding ROOT/<client>/
    <label>/<image> and ROOT/fedpipe-data.yaml): give each client a site of its own, work/sites/<client>/files holding
    only that client's folder and a copy of the manifest (each site then splits its files itself), and write the spec
    (its data shape comes from the sites' census). Returns (spec file, {client: site data URL})."""
    import shutil

    from fedpipe.data.files import open_data, read_manifest
    from fedpipe.data.files.manifest import MANIFEST_NAME
    from fedpipe.federation.own_data import site_params
    from fedpipe.federation.spec import FederationSpec

    params = site_params(cfg)  # refuses what a federation cannot do before anything is copied
    root = Path(str(cfg.data.source))
    source, _ = open_data(str(root))
    if read_manifest(source, source.list()).source.layout != "image_folders" or not root.is_dir():
        raise ValueError(f"the try-out gives each client of {root} its own site folder: it needs a local folder of image "
                         "folders (<client>/<label>/<image>); a table's sites each need their own file")
    clients = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    urls = {}
    for client in clients:
        files = work / "sites" / client / "files"
        if files.exists():
            shutil.rmtree(files)
        shutil.copytree(root / client, files / client)
        shutil.copy2(root / MANIFEST_NAME, files / MANIFEST_NAME)
        urls[client] = str(files)
    spec = FederationSpec.for_sites(cfg, len(clients), params)
    spec_file = work / "spec.json"
    spec_file.write_text(spec.to_json())
    return spec_file, urls


def run_tryout(cfg, work: str | Path, env: str | Path = DEFAULT_ENV, timeout: float = 900) -> dict:
    """`fedpipe site try`: the config run as a loopback federation, one site process per client, everything stopped
    at the end. Own image folders (data.dataset=files): each site gets its client's folder and splits it itself;
    a bundled dataset: the simulation's partition exported, one folder of tensors per client. Returns result.json."""
    work = Path(work).resolve()
    own = cfg.data.dataset == "files"
    if own:
        spec_file, urls = prepare_own_files(cfg, work)
        sites = [(work / "sites" / client, {"data": url}) for client, url in urls.items()]
    else:
        spec_file, folders = prepare(cfg, work)
        sites = [(folder, {}) for folder in folders]
    fed = cfg.federation
    with LoopbackFederation(work, env) as federation:
        for folder, node in sites:
            federation.start_site(folder, node_config=node)
        return federation.run(spec_file, work / "out", max(timeout, fed.connect_timeout), fed.round_timeout, fed.rejoin_wait)


def main(argv: list[str] | None = None) -> int:
    """`python -m fedpipe.federation.tryout`, as `fedpipe site try` (kept for the Flower environment's tests)."""
    import argparse

    from fedpipe.run.config import load_config

    p = argparse.ArgumentParser(description="Run a fedpipe config as a loopback federation (SuperLink + one site per client).")
    p.add_argument("-c", "--config")
    p.add_argument("--set", action="append", default=[], help="config override, as fedpipe run --set")
    p.add_argument("--work", required=True, help="folder for certificates, sites, logs and the result")
    p.add_argument("--env", default=str(DEFAULT_ENV), help="the Flower environment (scripts/flower-env.sh)")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    print(json.dumps(run_tryout(load_config(a.config, a.set), a.work, a.env, a.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
