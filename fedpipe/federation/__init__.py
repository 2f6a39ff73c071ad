"""Federation mode: the same methods run over Flower 1.42's deployment engine (a SuperLink and one
SuperNode per site), each site keeping its own data and personal state.

What runs where:
- `spec`: the one JSON document both sides build the algorithm from (method, train, engine, model, seed).
- `server_app`: the ServerApp (the phase task's side): rounds from `fedpipe.engine.rounds.run_phase`,
  with a `RoundTrainer` that sends each client's download to its site and checks each upload.
- `client_app`: the ClientApp (a site's side): loads only its own folder and trains with
  `fedpipe.engine.clients.ClientTrainer`, the code the simulation trains clients with.
- `worker`: a site's one long-lived process, which answers its SuperNode (`supernode`: Flower's, with a shorter idle
  pull, in process isolation) with `client_app` and nothing else: it checks each run's app bundle (`app`) and each
  message against the site's own `policy` before any data is read, and logs what it took or refused (`site_log`).
- `sites`: a site's folder (its splits and its personal state store); `transport`: tensors <-> Flower
  records and the upload check; `certs`: a try-out CA, server certificate and site keys; `tryout`: one
  machine, a SuperLink and N sites, started and stopped.

This package is imported by Flower's processes, which run in the separate environment that
scripts/flower-env.sh builds (flwr 1.42 pins typer, fastapi and starlette below what .venv needs).
`spec`, `sites`, `certs` and `tryout` import no Flower module, so .venv can prepare a federation.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Where Flower's processes come from: FEDPIPE_FLOWER_ENV (the image sets /opt/flower), else the checkout's
#: .cache/flower-venv that scripts/flower-env.sh builds
FLOWER_ENV_VAR = "FEDPIPE_FLOWER_ENV"


def flower_env() -> Path:
    """The Python environment holding Flower 1.42 (its bin/ has flower-superlink, flower-supernode, flwr)."""
    return Path(os.environ.get(FLOWER_ENV_VAR) or Path(__file__).resolve().parents[2] / ".cache" / "flower-venv")
