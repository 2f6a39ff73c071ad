"""A run's partition manifest read back from the store: bounded, validated, and matched to the data."""

from __future__ import annotations

from pydantic import ValidationError

from fedpipe.data import DatasetBundle
from fedpipe.data.partition import Partition
from fedpipe.errors import CorruptArtifactError, StoreError
from fedpipe.run.config import RunConfig
from fedpipe.run.layout import RunLayout
from fedpipe.run.record import FRESH
from fedpipe.safe_load import manifest_byte_limit, read_store_json
from fedpipe.store import Store


def load_partition(store: Store, layout: RunLayout, cfg: RunConfig, bundle: DatasetBundle) -> Partition:
    key = layout.partition_manifest
    if not store.exists(key):
        raise StoreError(f"{store.url(key)} is missing: run `fedpipe partition` first.")
    url = store.url(key)
    # bounded by what this config's split of this dataset can produce (semantic_groups: <= one client per row)
    p, pool = cfg.partition, len(bundle.train)
    clients = getattr(p, "num_clients", None) or pool
    shared = clients * getattr(p, "samples_per_client", 0) if p.clients_share_samples else None
    limit = manifest_byte_limit(pool, clients, bundle.num_classes, shared)
    tree = read_store_json(store, key, "partition manifest", limit, CorruptArtifactError, FRESH)
    try:
        partition = Partition.from_manifest(tree)
    except ValidationError as e:  # pydantic's first line names only the model: name the fields
        raise CorruptArtifactError(f"{url} is not a valid partition manifest: {manifest_errors(e)}. Start the run over with `fedpipe run --fresh`.") from None
    except ValueError as e:  # not JSON (or not UTF-8): the file's content is wrong
        raise CorruptArtifactError(f"{url} is not a valid partition manifest: {str(e).splitlines()[0]}. Start the run over with `fedpipe run --fresh`.") from None
    partition.check_matches(bundle)
    return partition


def manifest_errors(err: ValidationError, most: int = 3) -> str:
    """'clients.0.sizes.train: Input should be ... (got -1)' for the first few errors."""
    parts = []
    for e in err.errors()[:most]:
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("tagged-union", "function-")))
        got = repr(e.get("input"))
        got = got if len(got) <= 40 else got[:37] + "..."
        parts.append(f"{loc or '(top level)'}: {e['msg']}" + ("" if e["type"] == "missing" else f" (got {got})"))
    more = err.error_count() - most
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
