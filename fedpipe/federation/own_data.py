"""A site's own data: the site reads its own files (its own fedpipe-data.yaml, a folder or an S3 prefix) and makes
its splits itself, exactly as the simulation of all sites' files would make them; no sample leaves it.

Why the splits agree with the simulation's: a user's files give every sample an identity (`fedpipe.data.identity`:
its client's name and file name, or its id column), and `fedpipe.data.partition.make.make_partition` draws each
sample's global-test hold-out and its train / validation / test split from (seed, identity) alone. A site that holds
one client's files therefore puts each of its samples where the simulation of the pooled files puts it
(`make_partition(..., share=True)`: its share of the global test set may be empty). The standardisation must not
read other sites' data: fixed or declared constants (`RunConfig.standardisation` resolves auto to fixed in
federation mode).

What the site releases before training is its census (`census`): its name, label names, input shape, the label
counts of each split and its data's snapshot digest. The server checks that the sites agree on labels and shapes
and draws the partition heatmap from the counts (`fedpipe.federation.census`).

The prepared tensors are cached in the site's folder, keyed by the run's data parameters and the data's snapshot
(`prepared/<key>.safetensors`): Flower starts a fresh ClientApp process for every message, and decoding the files
once per run is enough.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from fedpipe.data.datasets import DataConfig, load_dataset
from fedpipe.data.federated import ClientData, FederatedData, Split, Standardisation, prepare_data
from fedpipe.data.files import current_snapshot
from fedpipe.data.partition.make import make_partition
from fedpipe.errors import ConfigError, DataError

PREPARED = "prepared"
SPLITS = ("train", "val", "test", "holdout")


def site_params(cfg) -> dict:
    """What a site needs to split and standardise its files as the run would (from a `fedpipe.run.config.RunConfig`,
    in .venv): the data reading options, the partition's fractions, the seed and the resolved standardisation."""
    if cfg.data.dataset != "files" or cfg.partition.scheme != "natural":
        raise ConfigError("engine.mode=federation reads each site's own files: set data.dataset=files and "
                          f"partition.scheme=natural (the sites are the clients), not data.dataset={cfg.data.dataset}, "
                          f"partition.scheme={cfg.partition.scheme}. `fedpipe site try` splits a bundled dataset into site folders.")
    if cfg.partition.opt_out_fraction or cfg.partition.feature_shift:
        raise ConfigError("in a federation a site opts out itself (`fedpipe site join --opt-out`) and its data is what it is: "
                          "leave partition.opt_out_fraction at 0 and partition.feature_shift empty")
    chosen = cfg.standardisation()
    if chosen.source == "pooled":
        raise ConfigError("data.standardisation=pooled needs every site's pixels in one place: in a federation use fixed "
                          "(or auto) or declare data.input_mean and data.input_std")
    return {"data": cfg.data.model_dump(mode="json", include={"image_size", "max_decoded_mb"}),
            "partition": cfg.partition.model_dump(mode="json"), "seed": int(cfg.run.seed), "standardisation": asdict(chosen)}


def _key(params: dict, snapshot: dict) -> str:
    text = json.dumps({"params": params, "snapshot": snapshot["digest"]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def prepare_own(url: str, params: dict, folder: str | Path, device: torch.device,
                max_cache_mb: int | None = None) -> tuple[dict[str, Split], dict]:
    """This site's splits (train, val, test and its share of the global test set, `holdout`) and its census, made
    from its files at `url` with the run's `params` (`site_params`), cached in `folder` (at most `max_cache_mb` of
    it: the least recently used entries go first, `prune_cache`)."""
    folder = Path(folder)
    snapshot = current_snapshot(url)
    key = _key(params, snapshot)
    data_file, census_file = folder / PREPARED / f"{key}.safetensors", folder / PREPARED / f"{key}.json"
    if data_file.exists() and census_file.exists():
        t = safetensors.torch.load_file(str(data_file), device=str(device))
        return {s: Split(t[f"{s}_x"], t[f"{s}_y"]) for s in SPLITS}, json.loads(census_file.read_text())

    data_cfg = DataConfig.model_validate({**params["data"], "dataset": "files", "source": url})
    bundle = load_dataset(data_cfg)
    names = bundle.client_names
    if len(names) != 1:
        raise DataError(f"{url} holds {len(names)} clients ({', '.join(names[:5])}{' ...' if len(names) > 5 else ''}): a site "
                        "holds one client's files (its own folder, or rows with one client value). Give each client its own site.")
    partition = make_partition(bundle, params["partition"], params["seed"], share=True)
    data = prepare_data(bundle, partition, device, Standardisation(**{k: tuple(v) if isinstance(v, list) else v
                                                                     for k, v in params["standardisation"].items()}))
    (client,) = data.clients
    splits = {"train": client.train, "val": client.val, "test": client.test, "holdout": data.global_test}
    counts = {s: np.bincount(splits[s].y.cpu().numpy(), minlength=bundle.num_classes).tolist() for s in SPLITS}
    census = {"name": names[0], "labels": list(bundle.class_names), "input_shape": list(bundle.input_shape),
              "num_classes": bundle.num_classes, "counts": counts, "snapshot": snapshot}
    data_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = data_file.with_suffix(".tmp")
    safetensors.torch.save_file({f"{s}_{v}": getattr(splits[s], v).detach().cpu().contiguous() for s in SPLITS for v in ("x", "y")},
                                str(tmp))
    tmp.replace(data_file)
    census_file.write_text(json.dumps(census))
    if max_cache_mb is not None:
        prune_cache(folder / PREPARED, max_cache_mb, keep=key)
    return splits, census


def prune_cache(prepared: Path, max_mb: int, keep: str) -> list[str]:
    """Remove the least recently written prepared splits (a .safetensors and its .json) until the folder holds at most
    `max_mb` megabytes, never the entry `keep`; returns the keys removed. A run with other data parameters (another
    image size) prepares another entry: without a bound they would pile up."""
    entries = {}
    for f in prepared.glob("*.safetensors"):
        st = f.stat()
        entries[f.stem] = (st.st_mtime, st.st_size + ((prepared / f"{f.stem}.json").stat().st_size if (prepared / f"{f.stem}.json").exists() else 0))
    total, removed = sum(size for _, size in entries.values()), []
    for stem, (_, size) in sorted(entries.items(), key=lambda kv: kv[1][0]):
        if total <= max_mb * 2**20:
            break
        if stem == keep:
            continue
        for suffix in (".safetensors", ".json"):
            (prepared / f"{stem}{suffix}").unlink(missing_ok=True)
        total -= size
        removed.append(stem)
    return removed


def site_federated_data(splits: dict[str, Split], client_id: int, opt_out: bool, num_classes: int,
                        input_shape: tuple[int, ...]) -> FederatedData:
    """The one-client `FederatedData` a site trains and evaluates on (its hold-out share as the global test set)."""
    client = ClientData(client_id, splits["train"], splits["val"], splits["test"], opt_out)
    return FederatedData((client,), splits["holdout"], num_classes, tuple(input_shape))
