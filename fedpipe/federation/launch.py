"""`fedpipe run` with engine.mode=federation, and the pipeline's federation tasks: the run's server side submitted to a
SuperLink the sites have joined.

The run's config goes to the sites as the spec (`FederationSpec.for_sites`: the method, training, seed and the data
parameters each site splits its own files with); `flwr run` starts fedpipe's ServerApp at the SuperLink
(`fedpipe.federation.server_app`: the census, every phase's rounds, the sites' evaluation). The two sides meet in the
run's store, `<store>/<run>/federation/` (`fedpipe.federation.outputs`): this side puts spec.json there (and the
model line's champion), the ServerApp its outputs and result.json, which this side waits for:

    spec.json, census.json, rounds.jsonl, global.safetensors, evaluation.json, server-state.pt (the checkpoint a
    rerun resumes from), result.json or error.json; champion.safetensors when the run is gated against a model line's
    promoted version, warm-start.safetensors when it starts from a version (train.init_from; `fedpipe.models.federated`)

and then the run's report from them, where a simulation's goes (`<store>/<run>/report/`, `fedpipe.federation.report`).

The store is a folder the SuperLink's machine shares with this one, or s3:// (Kubeflow's MinIO on a cluster: the
chart gives the SuperLink's pod the store's credentials), and must be one the SuperLink serves (FEDPIPE_SERVER_STORE,
`fedpipe.federation.places`). The submission sends the SuperLink's Control API token from FEDPIPE_CONTROL_TOKEN_FILE
(`fedpipe.federation.control`; the chart mounts it into the pipeline's federation tasks); without it fedpipe's SuperLink
refuses the run. A submission may stop after one stage (`stage`: the
census, one phase, the evaluation), which is how the pipeline runs one task per stage; `fedpipe run` submits the
whole run at once.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch

from fedpipe.engine.accounting import Ledger
from fedpipe.errors import ConfigError
from fedpipe.federation.outputs import SubmittedRun
from fedpipe.federation.report import write_report
from fedpipe.federation.tryout import DEFAULT_ENV, submit_app, write_connection

CONNECTION = "fedpipe-run"


def site_count(cfg) -> int:
    """How many sites the run waits for: federation.sites, else as many as federation.site_names names."""
    fed = cfg.federation
    count = fed.sites or len(fed.site_names)
    if not count:
        raise ConfigError("federation.sites: say how many sites the run waits for before its first round (or name them in "
                          "federation.site_names)")
    return count


def submission(cfg) -> SubmittedRun:
    from fedpipe.run.run import Run

    return SubmittedRun(str(cfg.run.store), Run(cfg).layout.run_id)


def check_federation(cfg, env: str | Path = DEFAULT_ENV) -> Path:
    """What a submission needs before anything is sent; returns the `flwr` program."""
    fed = cfg.federation
    if cfg.engine.mode != "federation":
        raise ConfigError("this runs engine.mode=federation configs only")
    if not fed.root_certificates or not Path(fed.root_certificates).is_file():
        raise ConfigError(f"federation.root_certificates={fed.root_certificates}: TLS is always on; name the CA certificate (PEM) "
                          "the SuperLink's certificate is signed with (`fedpipe federation certs` makes one; on a cluster the "
                          "chart mounts it)")
    site_count(cfg)
    flwr = Path(env) / "bin" / "flwr"
    if not flwr.exists():
        raise ConfigError(f"{flwr} not found: build the Flower environment with scripts/flower-env.sh (the image has /opt/flower)")
    return flwr


def _safetensors(params: dict[str, torch.Tensor] | None) -> bytes | None:
    return None if params is None else safetensors.torch.save({k: t.detach().cpu().contiguous() for k, t in params.items()})


def submit(cfg, stage: str = "", champion: dict[str, torch.Tensor] | None = None, env: str | Path = DEFAULT_ENV,
           warm_start: dict[str, torch.Tensor] | None = None, warm_ledger: Ledger | None = None) -> SubmittedRun:
    """Put the run's spec (and the champion, and the warm start's global model and privacy ledger) into the run's
    store and start the ServerApp at the SuperLink, to stop after `stage` (empty: the whole run); returns the
    submission to wait on."""
    from fedpipe.federation.own_data import site_params
    from fedpipe.federation.spec import FederationSpec

    flwr, fed = check_federation(cfg, env), cfg.federation
    run = submission(cfg)
    spec = FederationSpec.for_sites(cfg, site_count(cfg), site_params(cfg))
    run.submit(spec.to_json(), _safetensors(champion), _safetensors(warm_start),
               None if warm_ledger is None else json.dumps(warm_ledger.to_json()).encode())
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    with tempfile.TemporaryDirectory(prefix="fedpipe-submit-") as tmp:
        home = Path(tmp) / "flwr-home"
        write_connection(home, CONNECTION, fed.superlink, fed.root_certificates)
        environ.update({"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0"})
        submit_app(flwr, environ, Path(tmp) / "app", CONNECTION, None, None, fed.connect_timeout, fed.round_timeout, fed.rejoin_wait,
                   store=str(cfg.run.store), prefix=run.prefix, stop_after=stage)
    return run


def budget(cfg) -> float:
    """How long a submission is waited for: the census, then every round at four round timeouts."""
    fed = cfg.federation
    return fed.connect_timeout + fed.round_timeout * max(cfg.train.rounds, 1) * 4


def federate(cfg, env: str | Path = DEFAULT_ENV, timeout: float | None = None,
             champion: dict[str, torch.Tensor] | None = None, stage: str = "",
             on_poll: Callable[[SubmittedRun], None] = lambda run: None, warm_start: dict[str, torch.Tensor] | None = None,
             warm_ledger: Ledger | None = None) -> dict:
    """Run `cfg` (engine.mode=federation) through `cfg.federation.superlink` and wait. The whole run (`stage` empty or
    "evaluate") returns the run's summary (`fedpipe.federation.report.write_report`, the report written into the run's
    store); a stage before it returns the ServerApp's result.json. `champion`: the server state of the model line's
    promoted version, which the sites then score beside the new global model (the gate's figures, in evaluation.json).
    `warm_start`: the global model the server starts from instead of the seeded one (train.init_from's version);
    `warm_ledger`: with privacy, that version's accountant, which the server's continues.
    `on_poll(run)` is called while waiting (the pipeline's phase task forwards the new rounds' metrics)."""
    run = submit(cfg, stage, champion, env, warm_start, warm_ledger)
    result = run.wait(timeout or budget(cfg), on_poll=lambda: on_poll(run))
    if stage not in ("", "evaluate"):
        return result
    return write_federated_report(cfg, run)


def write_federated_report(cfg, run: SubmittedRun | None = None) -> dict:
    """The run's report from the ServerApp's outputs in the store, written into the store's report folder."""
    from fedpipe.run.run import Run

    run = run or submission(cfg)
    layout = Run(cfg).layout
    with tempfile.TemporaryDirectory(prefix="fedpipe-report-") as tmp:
        out, report = run.fetch(Path(tmp) / "federation"), Path(tmp) / "report"
        summary = write_report(out, report, f"{cfg.method.name}, federated over {site_count(cfg)} sites ({layout.run_id})",
                               (run.url, run.store.url(layout.report("report.html"))), method=cfg.method.name)
        for path in sorted(report.iterdir()):
            run.store.put(layout.report(path.name), path.read_bytes())
    return summary
