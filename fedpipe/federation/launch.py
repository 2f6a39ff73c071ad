"""`fedpipe run` with engine.mode=federation: the run's server side submitted to a SuperLink the sites have joined.

The run's config goes to the sites as the spec (`FederationSpec.for_sites`: the method, training, seed and the data
parameters each site splits its own files with); `flwr run` starts fedpipe's ServerApp at the SuperLink
(`fedpipe.federation.server_app`: the census, every phase's rounds, the sites' evaluation), which writes into the
run's folder of the run store, `<store>/<run>/federation/`:

    spec.json, census.json (+ census.png, drawn here), rounds.jsonl, global.safetensors, evaluation.json,
    server-state.pt (the checkpoint a rerun resumes from), result.json or error.json

Where the ServerApp runs: in Flower 1.42 the SuperLink's SuperExec starts it on the SuperLink's machine, so the
run store must be a folder that machine writes and this one reads (the same machine, or a shared volume); an
s3:// run store is refused here until the ServerApp writes through the store (docs/federation.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fedpipe.errors import ConfigError
from fedpipe.federation.tryout import DEFAULT_ENV, submit_app, wait_result, write_connection

CONNECTION = "fedpipe-run"


def federation_folder(cfg) -> Path:
    from fedpipe.run.run import Run

    return Path(cfg.run.store) / Run(cfg).layout.folder / "federation"


def federate(cfg, env: str | Path = DEFAULT_ENV, timeout: float | None = None) -> dict:
    """Run `cfg` (engine.mode=federation) through `cfg.federation.superlink` and wait; returns the run's summary
    (`summarise`)."""
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
    for stale in ("result.json", "error.json"):
        (out / stale).unlink(missing_ok=True)
    submit_app(flwr, environ, out / "app", CONNECTION, out / "spec.json", out, fed.connect_timeout, fed.round_timeout, fed.rejoin_wait)
    budget = timeout or fed.connect_timeout + fed.round_timeout * max(cfg.train.rounds, 1) * 4
    wait_result(out, budget)
    return summarise(out)


def summarise(out: Path) -> dict:
    """What a federated run reports: the sites by name, each one's scores, the global model's accuracy over the sites'
    held-out shares, and per round the clients, failures and bytes; the census heatmap drawn beside it."""
    from fedpipe.plots import census_heatmap

    census = json.loads((out / "census.json").read_text())
    scores = json.loads((out / "evaluation.json").read_text())
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines() if line.strip()]
    names = {str(s["client_id"]): s["name"] for s in census["sites"]}
    sites = {names.get(cid, cid): s for cid, s in scores.items()}
    held = sum(s.get("holdout-samples", 0) for s in scores.values())
    summary = {
        "sites": len(census["sites"]),
        "personalized_accuracy": sum(s["accuracy"] for s in scores.values()) / max(len(scores), 1),
        "global_accuracy": (sum(s["holdout-accuracy"] * s["holdout-samples"] for s in scores.values() if "holdout-samples" in s) / held
                            if held else None),
        "rounds": len(rounds), "failed_clients": sum(r["failed"] for r in rounds),
        "bytes_up": sum(r["bytes_up"] for r in rounds), "bytes_down": sum(r["bytes_down"] for r in rounds),
        "per_site": sites, "folder": str(out),
    }
    if census["sites"] and census["sites"][0].get("counts"):  # none with privacy: the sites withhold their counts
        summary["census_heatmap"] = str(census_heatmap(census, out / "census.png"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
