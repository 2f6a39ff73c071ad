"""A user's own federated data, made by the tests from data fedpipe does not bundle in this form:
scikit-learn's digits as PNG files in class folders per client (an image source with a natural label
skew per site), and scikit-learn's breast cancer table as Parquet with a `branch` column (a table whose
clients are cut by a feature, as a bank's branches or a hospital's sites would be)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

SITES = ("hospital-a", "hospital-b", "hospital-c", "hospital-d", "hospital-e")


def digit_sites() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uint8 images N x 8 x 8, labels, site index): each site holds four of the ten digits (site k:
    k*2 .. k*2+3 mod 10), each sample going to one of the sites that hold its class, in turn."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(digits.images * 16, 0, 255).astype(np.uint8)  # 0..16 -> 0..255
    labels = digits.target.astype(np.int64)
    holders = {c: [k for k in range(len(SITES)) if (c - 2 * k) % 10 < 4] for c in range(10)}
    seen = dict.fromkeys(range(10), 0)
    sites = np.empty(len(labels), dtype=np.int64)
    for i, c in enumerate(labels):
        sites[i] = holders[int(c)][seen[int(c)] % len(holders[int(c)])]
        seen[int(c)] += 1
    return images, labels, sites


def write_digit_folders(root: Path, limit: int | None = None) -> Path:
    """<root>/<site>/<digit>/<n>.png; `limit`: at most that many images (for quick tests)."""
    images, labels, sites = digit_sites()
    for i in range(len(labels) if limit is None else limit):
        folder = root / SITES[sites[i]] / str(labels[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i], mode="L").save(folder / f"{i}.png")
    return root


def breast_cancer_table(path: Path) -> Path:
    """The breast cancer table (569 rows, 30 features, malignant/benign) as Parquet, with a `branch`
    column cut from the quartiles of "mean texture" (so the branches differ in their inputs and labels)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    texture = data.data[:, list(data.feature_names).index("mean texture")]
    branch = np.searchsorted(np.quantile(texture, [0.25, 0.5, 0.75]), texture)
    columns = {name.replace(" ", "_"): data.data[:, j] for j, name in enumerate(data.feature_names)}
    columns["branch"] = [f"branch-{b}" for b in branch]
    columns["diagnosis"] = [str(data.target_names[t]) for t in data.target]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=128)
    return path


def upload_folder(raw_client, folder: Path, bucket: str, prefix: str, complete: bool = True) -> str:
    """Every file under `folder` to s3://bucket/prefix/ with the plain minio client (as a user's own tool
    would: no fedpipe metadata), then, with `complete`, an empty `_SUCCESS` as an exporter marks a finished
    drop (what `latest` waits for); returns the URL."""
    if not raw_client.bucket_exists(bucket):
        raw_client.make_bucket(bucket)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        raw_client.put_object(bucket, f"{prefix}/{path.relative_to(folder).as_posix()}", io.BytesIO(data), len(data))
    if complete:
        raw_client.put_object(bucket, f"{prefix}/_SUCCESS", io.BytesIO(b""), 0)
    return f"s3://{bucket}/{prefix}"
