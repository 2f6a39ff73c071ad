"""`fedpipe run` with engine.mode=federation: the run's server side submitted to a SuperLink the sites have joined.

The run's config goes to the sites as the spec (`FederationSpec.for_sites`: the method, training, seed and the data
parameters each site splits its own files with); `flwr run` starts fedpipe's ServerApp at the SuperLink
(`fedpipe.federation.server_app`: the census, every phase's rounds, the sites' evaluation), which writes into the
run's folder of the run store, `<store>/<run>/federation/`:

    spec.json, census.json, rounds.jsonl, global.safetensors, evaluation.json, server-state.pt (the checkpoint a
    rerun resumes from), result.json or error.json; champion.safetensors when the run is gated against a model line's
    promoted version (`fedpipe.models.federated`)

and then the run's report from them, where a simulation's goes (`<store>/<run>/report/`, `fedpipe.federation.report`).

Where the ServerApp runs: in Flower 1.42 the SuperLink's SuperExec starts it on the SuperLink's machine, so the
run store must be a folder that machine writes and this one reads (the same machine, or a shared volume); an
s3:// run store is refused here until the ServerApp writes through the store (docs/federation.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import safetensors.torch
import torch

from fedpipe.errors import ConfigError
from fedpipe.federation.report import write_report
from fedpipe.federation.resume import CHAMPION
from fedpipe.federation.tryout import DEFAULT_ENV, submit_app, wait_result, write_connection

CONNECTION = "fedpipe-run"


def federation_folder(cfg) -> Path:
    from fedpipe.run.run import Run

    return Path(cfg.run.store) / Run(cfg).layout.folder / "federation"


def report_folder(cfg) -> Path:
    from fedpipe.run.run import Run

    return Path(cfg.run.store) / Run(cfg).layout.report_dir


def federate(cfg, env: str | Path = DEFAULT_ENV, timeout: float | None = None,
             champion: dict[str, torch.Tensor] | None = None) -> dict:
    """Run `cfg` (engine.mode=federation) through `cfg.federation.superlink` and wait; returns the run's summary
    (`fedpipe.federation.report.write_report`). `champion`: the server state of the model line's promoted version,
    which the sites then score beside the new global model (the gate's figures, in evaluation.json)."""
    from fedpipe.federation.own_data import site_params
    from fedpipe.federation.spec import FederationSpec

    fed = cfg.federation
    if cfg.engine.mode != "federation":
        raise ConfigError("federate runs engine.mode=federation configs only")
    if "://" in str(cfg.run.store):
        raise ConfigError(f"run.store={cfg.run.store}: in federation mode the ServerApp writes the run's outputs on the SuperLink's "
                          "machine, so run.store must be a folder it shares with this one (an s3:// store is not wired yet)")
    if not fed.root_certificates or not Path(fed.root_certificates).is_file():
        raise ConfigError(f"federation.root_certificates={fed.root_certificates}: TLS is always on; name the CA certificate (PEM) "
                          "the SuperLink's certificate is signed with (`fedpipe site try` makes one for a try-out)")
    if not fed.sites:
        raise ConfigError("federation.sites: say how many sites the run waits for before its first round")
    flwr = Path(env) / "bin" / "flwr"
    if not flwr.exists():
        raise ConfigError(f"{flwr} not found: build the Flower environment with scripts/flower-env.sh")
    out = federation_folder(cfg).resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec = FederationSpec.for_sites(cfg, fed.sites, site_params(cfg))
    (out / "spec.json").write_text(spec.to_json())
    home = out / "flwr-home"
    write_connection(home, CONNECTION, fed.superlink, fed.root_certificates)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    environ.update({"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0"})
    for stale in ("result.json", "error.json", CHAMPION):
        (out / stale).unlink(missing_ok=True)
    if champion is not None:
        safetensors.torch.save_file({k: t.detach().cpu().contiguous() for k, t in champion.items()}, str(out / CHAMPION))
    submit_app(flwr, environ, out / "app", CONNECTION, out / "spec.json", out, fed.connect_timeout, fed.round_timeout, fed.rejoin_wait)
    budget = timeout or fed.connect_timeout + fed.round_timeout * max(cfg.train.rounds, 1) * 4
    wait_result(out, budget)
    return write_report(out, report_folder(cfg), f"{cfg.method.name}, federated over {fed.sites} sites ({federation_folder(cfg).parent.name})")
