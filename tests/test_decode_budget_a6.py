"""Memory on hostile drops, the second round (issue 43, A6): the default decoding budget is a share of the memory the
process may use (not a fixed 16 GiB), and every decode is counted before it allocates: an image while it is decoded
(from its header), the words of a text column while its vocabulary is counted, a dictionary-encoded column without
expanding it, and the rows' duplicate hash a few MiB at a time however wide a row is (an 8000x8000 PNG under a
256 MB budget peaked at 4.79 GB there, with no error).

Each probe runs in its own process, as `test_decode_budget.py` measures: peak RSS (VmHWM, reset at the start)
above the process's baseline. The processes run under an address-space limit (`ulimit -v`), so that the code
before these fixes fails here with a MemoryError instead of taking gigabytes; the default-budget probes use that
limit as the memory the process may use (`budget.available_memory`)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

PROBE = r'''
import json, sys
from fedpipe.data.files import check_files

def kb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

if len(sys.argv) > 3:  # the default budget as on a machine of this many bytes (the code before `auto` had none)
    try:
        import fedpipe.data.files.budget as budget
        budget.available_memory = lambda *_, **__: (int(sys.argv[3]), "a test's machine")
    except ImportError:
        pass
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to what the process holds now
base = kb("VmRSS") / 1024
try:
    check = check_files(sys.argv[1]) if sys.argv[2] == "default" else check_files(sys.argv[1], max_decoded_mb=int(sys.argv[2]))
    errors = [(p.kind, p.where, p.what) for p in check.problems.errors]
    rows = None if check.rows is None or not len(check.rows.x) else {"x": list(check.rows.x.shape), "first": check.rows.x.reshape(len(check.rows.x), -1)[0, :4].tolist()}
except MemoryError:
    errors, rows = [("MemoryError", "", "")], None
peak = kb("VmHWM") / 1024
print(json.dumps({"base_mb": base, "peak_mb": peak, "errors": errors, "rows": rows}))
'''
SLACK_MB = 64  # what reading takes besides the budget: Arrow's and Pillow's buffers, a file's bytes, the arrays' headers
LIMIT = 1536 * 2**20  # the image probes' address-space limit: the old code's gigabytes end in a MemoryError
TABLE = ("format: fedpipe-data\nversion: 1\nsource: {{layout: table, client_column: client, label_column: label, {inputs}}}\n"
         "labels: [a, b]\n")
IMAGES = "format: fedpipe-data\nversion: 1\nsource: {layout: image_folders, channels: 3}\nlabels: [a, b]\n"


def _probe(folder: Path, budget: int | Literal["default"], machine: int | None = None, limit: int | None = None) -> dict:
    """Check `folder` in a process of its own: the peak RSS, the errors, the rows' shape. `machine`: the memory
    the default budget sees; `limit`: an address-space limit (the image probes', where the old code took GBs;
    not the tables', whose reading maps a 4 GiB buffer it never touches)."""
    def cap() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    args = [str(folder), str(budget)] + ([str(machine)] if machine is not None else [])
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=300, preexec_fn=cap)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["above_mb"] = out["peak_mb"] - out["base_mb"]
    print(f"{folder.name} at {budget}: peak RSS {out['above_mb']:.0f} MB above a baseline of {out['base_mb']:.0f} MB; "
          f"{out['errors'][0][0] if out['errors'] else 'read'}")
    return out


def _refused(out: dict, budget_mb: int, *named: str) -> str:
    """The first error is the budget's, naming the file, what it would take, the budget and how to raise it."""
    assert out["errors"], out
    kind, where, what = out["errors"][0]
    assert kind == "over the decoding budget", out["errors"][:2]
    assert f"budget of {budget_mb:,} MB" in what and "raise data.max_decoded_mb" in what and " MB decoded" in what, what
    for text in named:
        assert text in where + what, (text, where, what)
    return what


def _within(out: dict, budget_mb: int) -> None:
    assert out["above_mb"] < budget_mb + SLACK_MB, f"peak {out['above_mb']:.0f} MB above baseline, budget {budget_mb} MB"


def _table(folder: Path, columns: dict, inputs: str, **options) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    pq.write_table(pa.table(columns), folder / "t.parquet", compression="zstd", write_statistics=False, **options)
    (folder / "fedpipe-data.yaml").write_text(TABLE.format(inputs=inputs))
    assert (folder / "t.parquet").stat().st_size < 16 * 2**10  # a tiny file on disk
    return folder


def _png(folder: Path, side: int, noise: bool = False) -> Path:
    from PIL import Image

    (folder / "site-0" / "a").mkdir(parents=True)
    if noise:  # incompressible, so that the image is what it seems
        pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "site-0" / "a" / "0.png", compress_level=1)
    else:
        Image.new("RGB", (side, side), (7, 0, 0)).save(folder / "site-0" / "a" / "0.png")
    (folder / "fedpipe-data.yaml").write_text(IMAGES)
    return folder


@pytest.fixture(scope="module")
def drops(tmp_path_factory) -> dict[str, Path]:
    """The A6 probes, sized so that the old code shows its fault without taking gigabytes: a tiny Parquet file whose
    client column is one 3 KB name on 262,144 rows (768 MB once expanded; the old code took 557 MB to read it), a
    text column of one 1 MB text of 350,000 two-letter words on 16 rows (a 1 KB file; 50 rows took 1.4 GB), one
    8000x8000 PNG (192 MB decoded, 0.2 MB on disk; 4.8 GB); and a 2500x2500 PNG of noise, a wide row to hash."""
    import pyarrow as pa

    root = tmp_path_factory.mktemp("a6")
    n, m = 2**18, 16
    client = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["c" * 3072]))
    label = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["a"]))
    text = pa.DictionaryArray.from_arrays(pa.array(np.zeros(m, np.int32)), pa.array(["ab " * (2**20 // 3)]))
    return {
        "parquet": _table(root / "parquet", {"client": client, "label": label, "f": pa.array(np.ones(n))}, "features: [f]",
                          data_page_size=2**30),
        "text": _table(root / "text", {"client": ["x", "y"] * (m // 2), "label": ["a", "b"] * (m // 2), "text": text},
                       "text_column: text"),
        "png": _png(root / "png", 8000),
        "wide": _png(root / "wide", 2500, noise=True),
    }


# --- the default: a share of the memory the process may use ------------------------------------------------


def _fake_machine(tmp_path: Path, meminfo_kb: int | None, v2: dict[str, str] | None = None,
                  v1: dict[str, str] | None = None) -> tuple[Path, Path]:
    """A /proc and a /sys/fs/cgroup of a machine with `meminfo_kb` available and the given cgroup limit files."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    lines = []
    if v2 is not None:
        lines.append("0::/kubepods/pod1/ctr")
        for where, value in v2.items():
            (cgroup / where).mkdir(parents=True, exist_ok=True)
            (cgroup / where / "memory.max").write_text(value + "\n")
    if v1 is not None:
        lines.append("4:memory:/docker/abc")
        for where, value in v1.items():
            (cgroup / "memory" / where).mkdir(parents=True, exist_ok=True)
            (cgroup / "memory" / where / "memory.limit_in_bytes").write_text(value + "\n")
    (proc / "self" / "cgroup").write_text("\n".join(lines) + "\n")
    (proc / "meminfo").write_text("MemTotal: 99999999999 kB\n" + (f"MemAvailable: {meminfo_kb} kB\n" if meminfo_kb else ""))
    return proc, cgroup


def test_the_default_budget_is_a_quarter_of_the_memory_the_process_may_use(tmp_path):
    from fedpipe.data.files.budget import AUTO_CAP_MB, AUTO_FLOOR_MB, auto_decoded_mb

    gib = 2**20  # in kB
    cases = {  # (MemAvailable kB, cgroup v2 files, v1 files, RLIMIT_AS) -> MB
        "a pod's cgroup v2 limit": (64 * gib, {"kubepods/pod1/ctr": "max", "kubepods/pod1": str(2 * 2**30)}, None, None, 512),
        "a container's cgroup v1 limit": (64 * gib, None, {"docker/abc": str(8 * 2**30), "": "9223372036854771712"}, None, 2048),
        "the machine's available memory, under a larger limit": (4 * gib, {"": str(32 * 2**30)}, None, None, 1024),
        "ulimit -v": (64 * gib, None, None, 3 * 2**30, 768),
        "no limit, capped": (256 * gib, {"": "max"}, None, None, AUTO_CAP_MB),
        "a tiny pod, floored": (64 * gib, {"": str(512 * 2**20)}, None, None, AUTO_FLOOR_MB),
    }
    for name, (available, v2, v1, rlimit, expected) in cases.items():
        proc, cgroup = _fake_machine(tmp_path / name.replace(" ", "_").replace(",", ""), available, v2, v1)
        mb, why = auto_decoded_mb(proc, cgroup, rlimit)
        assert mb == expected, (name, mb, why)
        assert "data.max_decoded_mb=auto" in why
    # and the process's own limits, as read: `ulimit -v 2 GiB` makes the default 512 MB
    done = subprocess.run([sys.executable, "-c", "from fedpipe.data.files.budget import DecodeBudget as B; b = B(); "
                           "print(b.limit // 2**20, '|', b.chosen)"], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2**31, 2**31)))
    assert done.returncode == 0, done.stderr[-2000:]
    mb, why = done.stdout.strip().split(" | ")
    assert int(mb) <= 512 and "ulimit -v" in why or "limit in" in why, (mb, why)


def test_the_field_defaults_to_auto_and_still_takes_a_number():
    from pydantic import ValidationError

    from fedpipe.data.datasets import DataConfig

    assert DataConfig().max_decoded_mb == "auto"
    assert DataConfig(max_decoded_mb=4096).max_decoded_mb == 4096
    assert DataConfig(max_decoded_mb="4096").max_decoded_mb == 4096  # a KFP run parameter arrives as text
    for bad in (0, -1, "lots", 2**25):
        with pytest.raises(ValidationError):
            DataConfig(max_decoded_mb=bad)


@pytest.mark.parametrize("probe", ["parquet", "text", "png"])
def test_at_the_default_budget_a_tiny_drop_stays_within_a_share_of_the_process_memory(drops, probe):
    """On a machine of 1 GiB the default budget is 256 MB: the Parquet file (768 MB once expanded) and the PNG
    (decoding it takes 451 MB) are refused, the text column is read; none takes more than the budget (the old
    fixed 16 GiB let them take 557 MB, 450 MB and 4.8 GB)."""
    out = _probe(drops[probe], "default", machine=2**30, limit=LIMIT if probe == "png" else None)
    if probe == "text":
        assert not out["errors"] and out["rows"]["x"] == [16, 64], out["errors"][:2]
    else:
        _refused(out, 256, "data.max_decoded_mb=auto: 25% of the 1.0 GiB", "a test's machine")
    _within(out, 256)


# --- every decode counted ---------------------------------------------------------------------------------


def test_a_large_png_under_a_low_budget_is_refused_from_its_header(drops):
    """8000x8000 RGB: 192 MB of pixels, 451 MB while Pillow decodes it; under 256 MB refused before decoding (the
    old code decoded it, then its duplicate hash took 4.6 GB more)."""
    out = _probe(drops["png"], 256, limit=LIMIT)
    what = _refused(out, 256, "0.png", "8000x8000")
    assert "decoding this 8000x8000 RGB image would take 451.2 MB decoded" in what
    _within(out, 256)


def test_a_wide_row_is_hashed_within_the_budget(drops):
    """One 2500x2500 image is one row of 18.75 MB: it fits a 96 MB budget decoded, and checking it for duplicates
    must not take a uint64 copy of it and a weight per byte (16 times the row: 300 MB)."""
    out = _probe(drops["wide"], 96, limit=LIMIT)
    assert not out["errors"] and out["rows"]["x"] == [1, 3, 2500, 2500], out["errors"][:2]
    _within(out, 96)


def test_a_text_columns_words_are_counted(drops):
    """16 rows of one 1 MB text: 16 MB of text is counted, and its words held as Python objects took 450 MB (50
    rows: 1.4 GB). Now the words are counted as they are read, the text tokenized once, and every row keeps its
    first 64 words."""
    out = _probe(drops["text"], 96)
    assert not out["errors"] and out["rows"]["x"] == [16, 64] and out["rows"]["first"] == [2, 2, 2, 2], out
    _within(out, 96)


def test_a_text_too_long_to_tokenize_within_the_budget_is_refused_naming_its_row(tmp_path):
    folder = _table(tmp_path / "long", {"client": ["x", "y"], "label": ["a", "b"], "text": ["ab " * (2**22 // 3), "cd"]},
                    "text_column: text")
    out = _probe(folder, 64)
    _refused(out, 64, "t.parquet row 1", "tokenizing this text of 4,194,303 characters")
    _within(out, 64)


def test_the_duplicate_hash_works_a_few_mib_at_a_time():
    import tracemalloc

    from fedpipe.data.files import _check_rows, _row_hashes
    from fedpipe.data.files.rows import ClientRows, Problems

    wide = np.random.default_rng(1).integers(0, 256, (3, 8 * 2**20), dtype=np.uint8)
    wide[2] = wide[0]  # one duplicate, under another client
    tracemalloc.start()
    hashes = _row_hashes(wide)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MB to hash 24 MB"  # the old hash: 8 bytes of weight and of product per byte
    assert hashes[0] == hashes[2] != hashes[1]
    problems = Problems()
    rows = ClientRows(wide, np.zeros(3, np.int64), np.array([0, 0, 1]), ("x", "y"), lambda i: f"row {i}")
    _check_rows(rows, problems)
    assert [(p.kind, p.where) for p in problems.warnings] == [("duplicated across clients", "row 2")]


def test_decoding_never_takes_more_than_its_header_said():
    """`decoding_bytes` is what decode_image is charged before it decodes: the measured peak stays within it
    (palette, grey, RGB and RGBA PNGs and a JPEG, kept or resized, one channel or three)."""
    script = r'''
import io, json
import numpy as np
from PIL import Image
from fedpipe.data.files.images import decode_image, decoding_bytes
from fedpipe.data.files.rows import Problems

def kb(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

rng = np.random.default_rng(0)
out = []
for mode, fmt in (("RGB", "PNG"), ("L", "PNG"), ("P", "PNG"), ("RGBA", "PNG"), ("RGB", "JPEG")):
    img = Image.fromarray(rng.integers(0, 256, (2400, 2600, 4), dtype=np.uint8), "RGBA").convert(mode)
    buf = io.BytesIO(); img.save(buf, fmt, compress_level=1) if fmt == "PNG" else img.save(buf, fmt); del img
    data = buf.getvalue()
    for channels in (1, 3):
        for size in (None, 64):
            header = Image.open(io.BytesIO(data))
            need = decoding_bytes(header.size, header.mode, channels, size)
            open("/proc/self/clear_refs", "w").write("5")
            base = kb("VmRSS")
            array = decode_image(data, "x", channels, size, Problems())
            used = (kb("VmHWM") - base) * 1024
            out.append([mode, fmt, channels, size, used, need, list(array.shape)])
            del array
print(json.dumps(out))
'''
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for mode, fmt, channels, size, used, need, shape in json.loads(done.stdout.strip().splitlines()[-1]):
        assert used <= need + 4 * 2**20, f"{mode} {fmt} to {channels} channel(s), size {size}: used {used / 2**20:.1f} MB, counted {need / 2**20:.1f} MB"
        assert shape == [channels, size or 2400, size or 2600]
