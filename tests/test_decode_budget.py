"""Tiny drops, huge memory (issue 30, item 4): a drop's decoded size is budgeted as a whole (data.max_decoded_mb),
so a few small, highly compressible files cannot claim gigabytes; messages quote values cut short. Each probe runs
in its own process and reports its peak RSS above the process's own baseline (fedpipe imported, before reading)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BUDGET_MB = 128
PROBE = r'''
import json, sys
from fedpipe.data.files import check_files

def kb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to what the process holds now
base = kb("VmRSS") / 1024
check = check_files(sys.argv[1], max_decoded_mb=int(sys.argv[2]))
peak = kb("VmHWM") / 1024
errors = [(p.kind, p.where, p.what) for p in check.problems.errors]
print(json.dumps({"base_mb": base, "peak_mb": peak, "errors": errors, "read": check.rows is not None,
                  "message_chars": sum(len(w) + len(x) for _, w, x in errors)}))
'''
TABLE = ("format: fedpipe-data\nversion: 1\nsource: {{layout: table, client_column: client, label_column: label, {inputs}}}\n"
         "labels: [a, b]\n")


def _probe(folder: Path, budget: int = BUDGET_MB) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(budget)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{folder.name}: peak RSS {out['peak_mb'] - out['base_mb']:.0f} MB above a baseline of {out['base_mb']:.0f} MB; "
          f"{out['errors'][0][0] if out['errors'] else 'no error'}")
    return out


def _refused_within_budget(out: dict, slack_mb: int) -> None:
    assert out["errors"][0][0] == "over the decoding budget", out["errors"][:2]
    assert f"budget of {BUDGET_MB} MB" in out["errors"][0][2] and "data.max_decoded_mb" in out["errors"][0][2]
    assert out["peak_mb"] - out["base_mb"] < BUDGET_MB + slack_mb, out


def _table(folder: Path, columns: dict, inputs: str, **options) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    pq.write_table(pa.table(columns), folder / "t.parquet", compression="zstd", **options)
    (folder / "fedpipe-data.yaml").write_text(TABLE.format(inputs=inputs))
    assert (folder / "t.parquet").stat().st_size < 2**20  # a small file on disk
    return folder


def test_a_dictionary_column_that_expands_to_gigabytes_is_refused_before_it_expands(tmp_path):
    import pyarrow as pa

    n = 4000  # one distinct 512 KB client name on every row: 2 GB once expanded
    client = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["c" * 2**19]))
    folder = _table(tmp_path / "dictionary", {"client": client, "label": ["a", "b"] * (n // 2), "f": [1.0] * n}, "features: [f]")
    _refused_within_budget(_probe(folder), slack_mb=64)


def test_a_compressed_text_bomb_is_refused_from_the_footer(tmp_path):
    n = 64  # 16 MB of one letter per row, stored plain: 1 GB decompressed, a few KB compressed
    folder = _table(tmp_path / "bomb", {"client": ["x", "y"] * (n // 2), "label": ["a", "b"] * (n // 2), "text": ["z" * 2**24] * n},
                    "text_column: text", use_dictionary=False)
    out = _probe(folder)
    _refused_within_budget(out, slack_mb=64)
    assert "decompressed" in out["errors"][0][2]


def test_long_values_are_quoted_cut_short(tmp_path):
    n = 2000  # every label an unknown 64 KB word: quoted whole, 128 MB of messages
    folder = _table(tmp_path / "long", {"client": ["x", "y"] * (n // 2), "label": ["q" * 2**16] * n, "f": [1.0] * n}, "features: [f]")
    out = _probe(folder, budget=4096)
    assert out["errors"] and out["message_chars"] < 2_000_000, out["message_chars"]


@pytest.mark.slow
def test_large_pngs_stop_at_the_budget(tmp_path):
    from PIL import Image

    root = tmp_path / "pngs"
    for k in range(8):  # 8000 x 8000 RGB: 192 MB each decoded, ~0.2 MB each on disk
        folder = root / f"site-{k % 2}" / ("a" if k < 4 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8000, 8000), (k, 0, 0)).save(folder / f"{k}.png")
    (root / "fedpipe-data.yaml").write_text("format: fedpipe-data\nversion: 1\nsource: {layout: image_folders, channels: 3}\nlabels: [a, b]\n")
    out = _probe(root, budget=BUDGET_MB)
    _refused_within_budget(out, slack_mb=64)
