"""A site's folder: its own splits and its own personal-state store, nothing of any other site.

Layout of a site folder (what `export_sites` writes from a simulation's partition, and the only thing
a site's ClientApp reads):
    site.json              {"client_id": k, "opt_out": false}
    data.safetensors       train_x, train_y, val_x, val_y, test_x, test_y (the client's tensors, as prepared)
    state/<phase>.safetensors   the personal state the method keeps at the site between rounds (written by the site;
                           its metadata names the run it belongs to, so another run's state is never read as this one's)

The try-out's exported splits are the simulation's own (`fedpipe.data.federated.prepare_data` of the run's
partition, standardised as the run does), so a federation can be compared with the simulation bit for bit.
A site with its own files (its own `fedpipe-data.yaml`) makes its splits itself (`fedpipe.federation.own_data`);
its folder then holds `prepared/` (the cached splits) and `state/`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import safetensors.torch
import torch

from fedpipe.data.federated import ClientData, FederatedData, Split

SITE_FILE, DATA_FILE, STATE_DIR = "site.json", "data.safetensors", "state"
#: what a site keeps of its latest finished run for serving its own models (`fedpipe.models.site_line`)
SERVED, LATEST, GLOBAL = "served", "latest.json", "global.safetensors"


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
    """One site's data and personal state, read from its own folder (and its own files) only.

    Two kinds of site folder: one the try-out exported from a simulation's partition (`site.json` and
    `data.safetensors`: the simulation's own tensors, for comparing a federation with it bit for bit), or a site
    with its own files (`data_url`, the `data` entry of its node config): it splits them itself with the run's
    parameters (`fedpipe.federation.own_data`) and learns its client id from the server (its rank among the
    sites' names, sorted as the simulation sorts its clients)."""

    def __init__(self, folder: str | Path, device: torch.device, num_classes: int, input_shape: tuple[int, ...],
                 data_url: str | None = None, site_data: dict | None = None, client_id: int | None = None, opt_out: bool = False,
                 max_cache_mb: int | None = None):
        self.folder = Path(folder)
        self.census: dict | None = None
        if data_url is not None:
            from fedpipe.federation.own_data import prepare_own, site_federated_data

            if not site_data:
                raise ValueError(f"site {self.folder}: its own files ({data_url}) need the run's data parameters (spec.site_data), "
                                 "which a run started with engine.mode=federation sends")
            splits, self.census = prepare_own(data_url, site_data, self.folder, device, max_cache_mb)
            self.client_id, self.opt_out = (-1 if client_id is None else int(client_id)), bool(opt_out)
            self.census = {**self.census, "opt_out": self.opt_out}
            self.data = site_federated_data(splits, self.client_id, self.opt_out, self.census["num_classes"],
                                            tuple(self.census["input_shape"]))
            return
        meta = json.loads((self.folder / SITE_FILE).read_text())
        self.client_id, self.opt_out = int(meta["client_id"]), bool(meta["opt_out"])
        if client_id is not None and int(client_id) != self.client_id:
            raise ValueError(f"site {self.folder} holds client {self.client_id}, but the server addressed it as client {client_id}")
        t = safetensors.torch.load_file(str(self.folder / DATA_FILE), device=str(device))
        split = lambda s: Split(t[f"{s}_x"], t[f"{s}_y"])  # noqa: E731
        client = ClientData(self.client_id, split("train"), split("val"), split("test"), self.opt_out)
        # ClientTrainer reads the device off global_test; an exported site has no global test share, only its own splits
        self.data = FederatedData((client,), client.test, num_classes, tuple(input_shape))

    @classmethod
    def from_node(cls, node_config, device: torch.device, spec=None, client_id: int | None = None, max_cache_mb: int | None = None) -> Site:
        """The site a SuperNode's node config names (`site-dir`; with its own files also `data` and `opt-out`)."""
        shape = tuple(spec.input_shape) if spec and spec.input_shape else (1,)
        url = node_config.get("data")
        return cls(str(node_config["site-dir"]), device, spec.num_classes if spec else 0, shape,
                   data_url=str(url) if url else None, site_data=spec.site_data if spec else None, client_id=client_id,
                   opt_out=str(node_config.get("opt-out", "false")).lower() in ("1", "true", "yes"), max_cache_mb=max_cache_mb)

    # --- the server's numbering of own-files sites (the census's), kept for the run's later messages ---------------
    ASSIGNED = "assigned.json"

    @staticmethod
    def _run_key(spec) -> str:
        return hashlib.sha256(spec.to_json().encode()).hexdigest()[:16]

    @classmethod
    def assign(cls, folder: str | Path, spec, client_id: int) -> None:
        """Keep the client id the server's census gave this site for the run of `spec` (written atomically)."""
        path = Path(folder) / cls.ASSIGNED
        known = json.loads(path.read_text()) if path.exists() else {}
        known[cls._run_key(spec)] = int(client_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(list(known.items())[-64:])))  # the latest runs' only
        tmp.replace(path)

    @classmethod
    def assigned(cls, folder: str | Path, spec) -> int:
        path = Path(folder) / cls.ASSIGNED
        known = json.loads(path.read_text()) if path.exists() else {}
        key = cls._run_key(spec)
        if key not in known:
            raise ValueError(f"site {folder} was sent a round of a run whose census it did not take part in (spec {key}): "
                             "the server numbers the sites before the first round")
        return int(known[key])

    # --- the personal state store (kept across rounds, phases and runs, never sent) -------------------
    def _state_path(self, phase: str) -> Path:
        return self.folder / STATE_DIR / f"{phase}.safetensors"

    def load_state(self, phase: str, device: torch.device, earlier: tuple[str, ...] = (), spec=None) -> dict[str, torch.Tensor] | None:
        """This phase's state, else the latest earlier phase's (`earlier`, in phase order): a client's state goes on
        from phase to phase, as `PhaseState.clients` does in the simulation. With `spec`, only a state written for the
        run of that spec counts (its restart included): another method's or run's state under the same phase name is
        none of this run's (it is overwritten by this run's first save)."""
        for name in (phase, *reversed(earlier)):
            path = self._state_path(name)
            if path.exists() and (spec is None or self._state_run(path) == self._run_key(spec)):
                return _held_or_read(path, device)
        return None

    @staticmethod
    def _state_run(path: Path) -> str | None:
        with safetensors.safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("run")

    def state_files(self) -> list[Path]:
        folder = self.folder / STATE_DIR
        return sorted(folder.glob("*.safetensors")) if folder.exists() else []

    def save_state(self, phase: str, state: dict[str, torch.Tensor] | None, spec=None) -> None:
        """Keep `state` as this phase's (with `spec`: marked as the state of that spec's run, see `load_state`)."""
        if state is None:
            return
        path = self._state_path(phase)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp),
                                    metadata={"run": self._run_key(spec)} if spec is not None else None)
        tmp.replace(path)  # atomic: a site killed mid-write keeps its previous state
        _HELD[path] = (_signature(path), {k: v.detach().clone() for k, v in state.items()})


#: the personal states a warm site worker wrote, kept in memory for its next round: {file: (its signature, tensors)};
#: read back only while the file on disk is the one written (same size, mtime and inode), else the file is read
_HELD: dict[Path, tuple[tuple, dict[str, torch.Tensor]]] = {}


def _signature(path: Path) -> tuple:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _held_or_read(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    held = _HELD.get(path)
    if held is not None and held[0] == _signature(path):
        return {k: v.clone().to(device) for k, v in held[1].items()}
    return safetensors.torch.load_file(str(path), device=str(device))


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


def keep_for_serving(folder: str | Path, spec_json: str, client_id: int, name: str, chosen: int, candidate: float, accuracy: float,
                 labels: list[str] | None, snapshot: dict | None, global_params: dict) -> None:
    """What `fedpipe.models.site_line.register_site_models` needs, written by the site at the run's evaluation (atomically,
    the global model first): the site's personalized model can then be exported and served where it is."""
    served = Path(folder) / SERVED
    served.mkdir(parents=True, exist_ok=True)
    tmp = served / (GLOBAL + ".tmp")
    safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in global_params.items()}, str(tmp))
    tmp.replace(served / GLOBAL)
    body = {"spec": spec_json, "client_id": client_id, "name": name, "chosen": chosen, "candidate": candidate,
            "accuracy": accuracy, "labels": labels, "snapshot": snapshot}
    tmp = served / (LATEST + ".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(served / LATEST)
