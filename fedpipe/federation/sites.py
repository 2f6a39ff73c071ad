"""A site's folder: its own splits and its own personal-state store, nothing of any other site.

Layout of a site folder (what `export_sites` writes from a simulation's partition, and the only thing
a site's ClientApp reads):
    site.json              {"client_id": k, "opt_out": false}
    data.safetensors       train_x, train_y, val_x, val_y, test_x, test_y (the client's tensors, as prepared)
    state/<phase>.safetensors   the personal state the method keeps at the site between rounds (written by the site)

For this first step the splits are the simulation's own (`fedpipe.data.federated.prepare_data` of the run's
partition, standardised as the run does), so a federation can be compared with the simulation bit for bit.
A site that makes its splits itself from its own `fedpipe-data.yaml` is the next step (docs/federation.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import safetensors.torch
import torch

from fedpipe.data.federated import ClientData, FederatedData, Split

SITE_FILE, DATA_FILE, STATE_DIR = "site.json", "data.safetensors", "state"


def site_name(client_id: int) -> str:
    return f"site-{client_id}"


def export_sites(data: FederatedData, out: str | Path) -> list[Path]:
    """One folder per client under `out` (site-<id>/), each holding only that client's tensors."""
    out = Path(out)
    folders = []
    for c in data.clients:
        folder = out / site_name(c.client_id)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"{s}_{v}": getattr(getattr(c, s), v).detach().cpu().contiguous() for s in ("train", "val", "test") for v in ("x", "y")}
        safetensors.torch.save_file(tensors, str(folder / DATA_FILE))
        (folder / SITE_FILE).write_text(json.dumps({"client_id": c.client_id, "opt_out": bool(c.opt_out)}))
        folders.append(folder)
    return folders


class Site:
    """One site's data and personal state, read from its own folder only."""

    def __init__(self, folder: str | Path, device: torch.device, num_classes: int, input_shape: tuple[int, ...]):
        self.folder = Path(folder)
        meta = json.loads((self.folder / SITE_FILE).read_text())
        self.client_id, self.opt_out = int(meta["client_id"]), bool(meta["opt_out"])
        t = safetensors.torch.load_file(str(self.folder / DATA_FILE), device=str(device))
        split = lambda s: Split(t[f"{s}_x"], t[f"{s}_y"])  # noqa: E731
        client = ClientData(self.client_id, split("train"), split("val"), split("test"), self.opt_out)
        # ClientTrainer reads the device off global_test; a site has no global test set, only its own
        self.data = FederatedData((client,), client.test, num_classes, tuple(input_shape))

    # --- the personal state store (kept across rounds, phases and runs, never sent) -------------------
    def _state_path(self, phase: str) -> Path:
        return self.folder / STATE_DIR / f"{phase}.safetensors"

    def load_state(self, phase: str, device: torch.device, earlier: tuple[str, ...] = ()) -> dict[str, torch.Tensor] | None:
        """This phase's state, else the latest earlier phase's (`earlier`, in phase order): a client's state goes on
        from phase to phase, as `PhaseState.clients` does in the simulation."""
        for name in (phase, *reversed(earlier)):
            path = self._state_path(name)
            if path.exists():
                return safetensors.torch.load_file(str(path), device=str(device))
        return None

    def state_files(self) -> list[Path]:
        folder = self.folder / STATE_DIR
        return sorted(folder.glob("*.safetensors")) if folder.exists() else []

    def save_state(self, phase: str, state: dict[str, torch.Tensor] | None) -> None:
        if state is None:
            return
        path = self._state_path(phase)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp))
        tmp.replace(path)  # atomic: a site killed mid-write keeps its previous state


def state_digest(state: dict[str, torch.Tensor] | None) -> int:
    """A 48-bit digest of a personal state (0 for none), reported with each round so that a test can tell which
    state a site trained from (e.g. the one it had before it was killed) without the state leaving the site."""
    if not state:
        return 0
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return int(h.hexdigest()[:12], 16)
