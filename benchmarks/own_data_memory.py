"""Memory and time of reading a user's own federated data (data.dataset: files): images, Parquet, CSV.

    .venv/bin/python benchmarks/own_data_memory.py                  # 10,000 images, 1,000,000 rows (~1 min on 2 cores)
    .venv/bin/python benchmarks/own_data_memory.py --quick          # 10x smaller: a smoke check (~30 s)
    .venv/bin/python benchmarks/own_data_memory.py --keep /tmp/own-data   # keep the generated files, reuse them next time

Three sources are generated once (into a temporary folder, or --keep DIR), each with the manifest
`fedpipe data init` proposes for it:

  images    --images 28x28 grayscale PNG files, <client>/<label>/<n>.png, 20 clients x 10 labels
            (a blurred per-label pattern, shifted and noised per image: digit-like, every file distinct)
  parquet   one Parquet file of --rows rows: a client column (100 clients), a label column (5 classes)
            and --features float32 feature columns
  csv       the same rows as one CSV file

and read in three stages, each measured in a FRESH process (nothing cached, nothing left over):

  snapshot  `current_snapshot(url)`: list the source and version every file (a folder hashes every
            file's bytes), the digest a run records as data.snapshot
  load      `load_files(url)`: listing, snapshot, reading and decoding every file or row, the checks
            (labels, clients, values, the same sample under two clients), the DatasetBundle
  prepare   `load_files`, then `make_partition(bundle, NaturalPartition(), 0)` and
            `prepare_data(bundle, partition, cpu)`: the float32 tensors the clients train on

Every child imports fedpipe, torch, pyarrow and Pillow first; the RSS it has then is the baseline. The
table gives its peak resident memory at the end (everything up to and including the stage, so `prepare`
includes its `load`; Linux's VmHWM, the child's own high-water mark: getrusage's ru_maxrss would carry
over this parent's peak across fork and exec), the peak over the baseline, and the seconds of the stage
alone (for `prepare`: partition + prepare_data, not the load before it). Beside them: the bytes on disk
(every file of the source), the decoded arrays (bytes of the bundle's x: uint8 images, float32 features)
and, for `prepare`, the tensors made (every client's splits and the global test set, x and y). The
peak over the baseline divided by the decoded bytes is the overhead of reading; the last line says it.

Children run with one torch thread. Results go to OUT/own_data_memory.md and OUT/own_data_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SOURCES = ("images", "parquet", "csv")
STAGES = ("snapshot", "load", "prepare")
IMAGE_CLIENTS, IMAGE_LABELS, IMAGE_SIDE = 20, 10, 28
TABLE_CLIENTS, TABLE_LABELS = 100, 5
TABLE_CHUNK = 100_000  # rows generated and written at a time
MARKER = ".own-data-benchmark.json"  # hidden: a source does not list it, so it is not part of the data
MIB = 2**20


# --- generating the data ---------------------------------------------------------------------------


def label_patterns(rng: np.random.Generator) -> np.ndarray:
    """One smooth 28x28 pattern per label: a random 7x7 field upsampled 4x, blurred, 0..1."""
    coarse = rng.random((IMAGE_LABELS, 7, 7))
    fine = coarse.repeat(4, axis=1).repeat(4, axis=2)
    for axis in (1, 2):  # a box blur along each axis softens the blocks into strokes
        fine = (np.roll(fine, 1, axis) + fine + np.roll(fine, -1, axis)) / 3
    return (fine - fine.min()) / (fine.max() - fine.min())


def write_images(root: Path, n: int, seed: int = 0) -> None:
    """n PNG files under root/<client>/<label>/<k>.png, spread evenly over the clients and labels."""
    from PIL import Image
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    patterns = label_patterns(rng)
    for i in tqdm(range(n), desc="images", unit="file"):
        client, label = i % IMAGE_CLIENTS, (i // IMAGE_CLIENTS) % IMAGE_LABELS
        shifted = np.roll(patterns[label], tuple(rng.integers(-3, 4, size=2)), axis=(0, 1))
        pixels = np.clip(255 * shifted + rng.normal(0, 24, shifted.shape), 0, 255).astype(np.uint8)
        path = root / f"client-{client:02d}" / str(label) / f"{i:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, mode="L").save(path, format="PNG")


def table_chunks(rows: int, features: int, seed: int = 0):
    """The table in chunks of TABLE_CHUNK rows, as pyarrow tables: client, label, f0..f{F-1}."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    for start in range(0, rows, TABLE_CHUNK):
        n = min(TABLE_CHUNK, rows - start)
        label = rng.integers(0, TABLE_LABELS, n)
        x = rng.standard_normal((n, features), dtype=np.float32)
        x[:, : min(features, TABLE_LABELS)] += np.eye(TABLE_LABELS, dtype=np.float32)[label][:, :features]
        client = pa.array([f"client-{k:03d}" for k in rng.integers(0, TABLE_CLIENTS, n)])
        columns = {"client": client, "label": pa.array(label), **{f"f{j}": pa.array(x[:, j]) for j in range(features)}}
        yield pa.table(columns)


def write_table(path: Path, rows: int, features: int) -> None:
    """The rows as one Parquet or CSV file (by path's suffix), written chunk by chunk."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq
    from tqdm import tqdm

    writer = None
    with tqdm(total=rows, desc=path.suffix[1:], unit="row", unit_scale=True) as progress:
        for chunk in table_chunks(rows, features):
            if writer is None:
                writer = (pq.ParquetWriter(path, chunk.schema) if path.suffix == ".parquet"
                          else pcsv.CSVWriter(path, chunk.schema))
            writer.write_table(chunk)
            progress.update(len(chunk))
    if writer is not None:
        writer.close()


def prepare_source(folder: Path, kind: str, size: dict) -> float:
    """Make `folder` hold the `kind` source of `size` with its manifest, unless it already does (its
    marker says so); returns the seconds spent generating (0 when reused)."""
    marker = folder / MARKER
    if marker.exists() and json.loads(marker.read_text()) == size:
        print(f"{kind}: reusing {folder}", file=sys.stderr)
        return 0.0
    if folder.exists() and any(folder.iterdir()):
        if not marker.exists():
            sys.exit(f"{folder} holds files this benchmark did not write; choose another --keep folder.")
        shutil.rmtree(folder)  # this benchmark's own data of another size
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if kind == "images":
        write_images(folder, size["images"])
    else:
        write_table(folder / f"rows.{kind}", size["rows"], size["features"])
    from fedpipe.data.files.init import init_manifest, write_manifest

    manifest, _ = init_manifest(str(folder))
    write_manifest(str(folder), manifest)
    marker.write_text(json.dumps(size))
    return time.perf_counter() - started


# --- one measurement, in a fresh process -----------------------------------------------------------


def proc_status_mib(field: str) -> float | None:
    """A memory field of /proc/self/status (VmHWM: peak RSS, VmRSS: RSS now) in MiB; None off Linux."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    kib = next((int(line.split()[1]) for line in lines if line.startswith(f"{field}:")), None)
    return None if kib is None else kib / 1024


def peak_mib() -> float:
    """This process's peak RSS: VmHWM, the high-water mark of its own memory since exec. getrusage's ru_maxrss
    is not used where VmHWM exists: Linux carries the forking parent's peak across exec into it, so a child of
    a parent that holds the generated data would report the parent's peak."""
    hwm = proc_status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mib() -> float:
    """This process's RSS now (VmRSS; the peak so far where /proc is not there)."""
    rss = proc_status_mib("VmRSS")
    return rss if rss is not None else peak_mib()


def tensor_bytes(data) -> int:
    """Bytes of every tensor of a FederatedData: each client's train/val/test x and y, the global test set."""
    splits = [getattr(c, s) for c in data.clients for s in ("train", "val", "test")] + [data.global_test]
    return sum(t.element_size() * t.nelement() for sp in splits for t in (sp.x, sp.y))


def measure(url: str, stage: str) -> dict:
    """Runs in the child: the stage (and the stages it needs before it); what it measured, as a dict."""
    import PIL.PngImagePlugin  # noqa: F401 - imported before the baseline, as the readers import it
    import pyarrow.csv  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import torch

    from fedpipe.data.federated import prepare_data
    from fedpipe.data.files import current_snapshot, load_files
    from fedpipe.data.partition import make_partition
    from fedpipe.data.partition.natural import NaturalPartition

    torch.set_num_threads(1)
    out = {"stage": stage, "baseline_mib": rss_mib(), "imports_peak_mib": peak_mib()}
    started = time.perf_counter()
    if stage == "snapshot":
        snapshot = current_snapshot(url)
    else:
        bundle = load_files(url)
        snapshot = bundle.snapshot
        out.update(samples=len(bundle.train.y), decoded_bytes=int(bundle.train.x.nbytes), x_dtype=str(bundle.train.x.dtype),
                   clients=len(bundle.client_names))
        if stage == "prepare":
            out.update(loaded_rss_mib=rss_mib(), loaded_peak_mib=peak_mib())
            started = time.perf_counter()
            data = prepare_data(bundle, make_partition(bundle, NaturalPartition(), 0), torch.device("cpu"))
            out["tensor_bytes"] = tensor_bytes(data)
    out.update(seconds=time.perf_counter() - started, peak_mib=peak_mib(),
               disk_bytes=snapshot["bytes"], objects=snapshot["objects"])
    return out


def run_child(url: str, stage: str) -> dict:
    """One stage in a fresh interpreter; its result is the last line of its stdout."""
    child = subprocess.run([sys.executable, __file__, "--child", url, stage], stdout=subprocess.PIPE, text=True, check=False)
    if child.returncode != 0:
        sys.exit(f"the {stage} stage on {url} failed (exit {child.returncode}); its log is above.")
    return json.loads(child.stdout.strip().splitlines()[-1])


# --- the table -------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    lines = [
        "| source | stage | files / rows | on-disk MiB | decoded MiB | tensors MiB | peak RSS MiB | over imports MiB | seconds |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        count = f"{r['count']:,} {'files' if r['source'] == 'images' else 'rows'}"
        tensors = f"{r['tensor_bytes'] / MIB:.1f}" if "tensor_bytes" in r else ""
        lines.append(
            f"| {r['source']} | {r['stage']} | {count} | {r['disk_bytes'] / MIB:.1f} | {r['decoded_bytes'] / MIB:.1f} | "
            f"{tensors} | {r['peak_mib']:.0f} | {r['peak_mib'] - r['baseline_mib']:.0f} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def interpretation(rows: list[dict]) -> str:
    """One line: per source, the largest peak over the imports as a multiple of the decoded arrays."""
    parts = []
    for source in dict.fromkeys(r["source"] for r in rows):
        mine = {r["stage"]: r for r in rows if r["source"] == source}
        ratios = {s: (r["peak_mib"] - r["baseline_mib"]) * MIB / r["decoded_bytes"] for s, r in mine.items()}
        parts.append(f"{source} " + ", ".join(f"{s} {ratio:.1f}x" for s, ratio in ratios.items()))
    return ("Peak RSS over the imports, as a multiple of the decoded arrays (load holds them once; prepare adds "
            "the float32 tensors): " + "; ".join(parts) + ".")


def measure_all(root: Path, sources: list[str], size: dict) -> tuple[list[dict], dict]:
    """Generate (or reuse) every source, then run every stage of each in its own process."""
    generated = {kind: prepare_source(root / kind, kind, size) for kind in sources}
    rows = []
    for kind in sources:
        results = {}
        for stage in STAGES:
            print(f"{kind}: {stage} (a fresh process)...", file=sys.stderr)
            results[stage] = run_child(str(root / kind), stage)
            r = results[stage]
            print(f"  {r['seconds']:.1f} s, peak RSS {r['peak_mib']:.0f} MiB", file=sys.stderr)
        decoded = results["load"]["decoded_bytes"]  # the snapshot stage decodes nothing: the load stage's size
        count = results["load"]["samples"]  # images: one file each; tables: rows
        rows += [{"source": kind, "count": count, **r, "decoded_bytes": decoded} for r in results.values()]
    return rows, generated


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=10_000, help="image files to generate (20 clients x 10 labels)")
    ap.add_argument("--rows", type=int, default=1_000_000, help="table rows to generate (100 clients, 5 classes)")
    ap.add_argument("--features", type=int, default=20, help="float32 feature columns of the table")
    ap.add_argument("--quick", action="store_true", help="a tenth of --images and --rows: a smoke check")
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES, help="sources to measure (default: all)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="generate the data here and keep it; a later run with the same sizes reuses it")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for own_data_memory.md and .json")
    ap.add_argument("--child", nargs=2, metavar=("URL", "STAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:  # one stage in this fresh process; the result is the last line of stdout
        print(json.dumps(measure(*args.child)))
        return

    scale = 10 if args.quick else 1
    size = {"images": max(IMAGE_CLIENTS * IMAGE_LABELS, args.images // scale), "rows": max(1000, args.rows // scale),
            "features": args.features}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="own-data-") as tmp:
        root = args.keep or Path(tmp)
        rows, generated = measure_all(root, args.sources, size)
    wall = time.perf_counter() - started
    report(args, argv, size, rows, generated, wall)


def report(args: argparse.Namespace, argv: list[str] | None, size: dict, rows: list[dict], generated: dict, wall: float) -> None:
    """Print the table and write OUT/own_data_memory.md and .json."""
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch 1 thread per child, nice {os.nice(0)}, "
               f"Python {platform.python_version()}")
    made = ", ".join(f"{k} {s:.0f} s" for k, s in generated.items() if s) or "none (reused --keep)"
    low, high = (f"{f(r['baseline_mib'] for r in rows):.0f}" for f in (min, max))
    baseline = low if low == high else f"{low}-{high}"
    command = " ".join(["benchmarks/own_data_memory.py", *(argv if argv is not None else sys.argv[1:])])
    text = (
        f"{size['images']:,} 28x28 grayscale PNG files ({IMAGE_CLIENTS} clients x {IMAGE_LABELS} labels); "
        f"{size['rows']:,} rows x {size['features']} float32 features ({TABLE_CLIENTS} clients, {TABLE_LABELS} classes) "
        f"as Parquet and as CSV; every stage in its own process ({machine}). Baseline (fedpipe, torch, pyarrow, Pillow "
        f"imported): {baseline} MiB.\n\n"
        + table(rows) + "\n\n" + interpretation(rows)
        + f"\n\nGenerating the data: {made}; the whole benchmark: {wall:.0f} s.\n\n`{command}`"
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "own_data_memory.md").write_text(text + "\n")
    (args.out / "own_data_memory.json").write_text(json.dumps(
        {"size": size, "machine": machine, "generated_seconds": generated, "wall_seconds": wall, "rows": rows}, indent=2))
    print(f"\nwrote {args.out / 'own_data_memory.md'} and {args.out / 'own_data_memory.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
