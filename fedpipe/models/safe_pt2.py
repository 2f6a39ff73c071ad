"""A .pt2 archive from the store, checked and rebuilt before `torch.export.load` sees it.

`torch.export.load` unpickles parts of an archive (torch 2.13: torch/export/pt2_archive/_package.py):

- a weight or a tensor constant whose payload config says `use_pickle: true`: `torch.load(weights_only=False)`;
- a constant file `custom_obj_*` (torch's own unpickler of script objects) or `opaque_obj_*` (`pickle.loads`);
- the sample inputs (`data/sample_inputs/<model>.pt`): `torch.load`, falling back to `weights_only=False`;
- the layouts older torch wrote (`data/weights/<model>.pt`, a zip with a top-level `version`): whole pickles;

so a bucket writer who swaps a version's `global.pt2` (and recomputes its sha256 wherever the line records
it) runs code in whoever loads it. `checked_pt2` reads the archive as a bounded zip (entry count, sizes, no
duplicate or unexpected names, one root folder) and allows only the entries fedpipe's exporters write: the
program (checked by `pt2_program.check_program`), the weight and constant configs with every payload raw
(`use_pickle: false`), the raw tensor files they name, and the archive's format markers. It returns a new
archive written from the entries it checked, with empty sample inputs (a served model never needs them), so
torch reads only bytes fedpipe read, whatever a zip reader makes of the original.
"""

from __future__ import annotations

import io
import json
import re
import zipfile

from fedpipe.errors import CorruptArtifactError
from fedpipe.models.pt2_program import check_program
from fedpipe.safe_load import parse_json

MAX_ENTRIES = 65_536  # one per tensor of the model and a few more: far beyond fedpipe's networks
MAX_PROGRAM_BYTES = 256 * 2**20
MAX_CONFIG_BYTES = 64 * 2**20
MODEL = "model"  # the one program `torch.export.save` writes and `torch.export.load` returns
PROGRAM = f"models/{MODEL}.json"
WEIGHTS_CONFIG, CONSTANTS_CONFIG = f"data/weights/{MODEL}_weights_config.json", f"data/constants/{MODEL}_constants_config.json"
SAMPLE_INPUTS = f"data/sample_inputs/{MODEL}.pt"
PAYLOADS = {WEIGHTS_CONFIG: ("data/weights/", re.compile(r"weight_[0-9]{1,9}")),
            CONSTANTS_CONFIG: ("data/constants/", re.compile(r"tensor_[0-9]{1,9}"))}
MARKERS = {"archive_format": re.compile(rb"pt2"), "archive_version": re.compile(rb"0"), "byteorder": re.compile(rb"little|big"),
           ".data/version": re.compile(rb"[0-9]{1,3}\n?"), ".data/serialization_id": re.compile(rb"[0-9A-Za-z]{0,64}")}


def checked_pt2(data: bytes, where: str, max_bytes: int) -> bytes:
    """The archive `data` rebuilt from its checked entries, for `torch.export.load`; anything else is a
    CorruptArtifactError naming `where` and what it holds. Entries may expand to `max_bytes` in all."""
    entries = _entries(data, where, max_bytes)
    program = _json(entries, PROGRAM, where, MAX_PROGRAM_BYTES)
    check_program(program, where)
    configs = {name: _payload_config(entries, name, where) for name in PAYLOADS}
    named = {PAYLOADS[name][0] + path for name, config in configs.items() for path in _paths(config)}
    expected = {*MARKERS, PROGRAM, SAMPLE_INPUTS, *PAYLOADS, *named}
    unexpected = sorted(set(entries) - expected)
    if unexpected:
        raise _refused(where, f"it holds {_shown(unexpected)}, which fedpipe's exporters never write (pickled weights of "
                              "older torch, compiled code, extra files)")
    missing = sorted((named | {PROGRAM, SAMPLE_INPUTS}) - set(entries))
    if missing:
        raise _refused(where, f"it lacks {_shown(missing)}")
    for marker, pattern in MARKERS.items():
        if marker in entries and not pattern.fullmatch(entries[marker]):
            raise _refused(where, f"its {marker} is not what torch writes")
    return _rebuilt(program, configs, {path: entries[path] for path in named})


def _entries(data: bytes, where: str, max_bytes: int) -> dict[str, bytes]:
    """{name under the root folder: bytes} of a zip archive within the bounds."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise _refused(where, f"it is not a .pt2 (zip) archive ({e})") from None
    if not infos or len(infos) > MAX_ENTRIES:
        raise _refused(where, f"it holds {len(infos)} entries (a .pt2 archive holds 1 to {MAX_ENTRIES:,})")
    root = infos[0].filename.split("/", 1)[0]
    total, out = 0, {}
    for info in infos:
        name = info.filename
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", root) or not name.startswith(root + "/") or info.is_dir():
            raise _refused(where, f"its entry {name[:100]!r} is not a file under the archive's one root folder")
        relative = name[len(root) + 1:]
        if relative in out or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise _refused(where, f"its entry {name[:100]!r} is stored twice or compressed in a way torch does not write")
        total += info.file_size
        if total > max_bytes:
            raise _refused(where, f"its entries expand to more than {max_bytes:,} bytes")
        try:
            out[relative] = archive.read(info)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError) as e:
            raise _refused(where, f"its entry {name[:100]!r} cannot be read ({e})") from None
    return out


def _json(entries: dict[str, bytes], name: str, where: str, limit: int) -> object:
    """An entry parsed as JSON; the program's nesting is walked by `check_program` (it nests deeper than fedpipe's
    own records, so parse_json's depth cap is not for it)."""
    if name not in entries:
        raise _refused(where, f"it lacks {name}")
    if name != PROGRAM:
        return parse_json(entries[name], f"{where} ({name})", "payload config", limit, CorruptArtifactError)
    if len(entries[name]) > limit:
        raise _refused(where, f"its program is larger than {limit:,} bytes")
    try:
        return json.loads(entries[name].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _refused(where, f"its program {PROGRAM} is not JSON ({type(e).__name__})") from None


def _payload_config(entries: dict[str, bytes], name: str, where: str) -> dict:
    """A weights or constants config whose every payload is a raw tensor file (no pickle, no custom object)."""
    tree = _json(entries, name, where, MAX_CONFIG_BYTES)
    config = tree.get("config") if isinstance(tree, dict) else None
    if not isinstance(config, dict) or set(tree) != {"config"}:
        raise _refused(where, f"its {name} is not a payload config")
    pattern = PAYLOADS[name][1]
    for fqn, meta in config.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise _refused(where, f"its {name} has {str(fqn)[:80]!r} stored as a pickle (use_pickle), which torch would "
                                  "unpickle and so run any code in it")
        path = meta.get("path_name")
        if not isinstance(path, str) or not pattern.fullmatch(path) or not isinstance(meta.get("tensor_meta"), dict):
            raise _refused(where, f"its {name} has {str(fqn)[:80]!r} in {str(path)[:80]!r}, not a raw tensor file "
                                  "(custom and opaque objects are pickles)")
    check_program(config, f"{where} ({name})")
    return tree


def _paths(config: dict) -> set[str]:
    return {meta["path_name"] for meta in config["config"].values()}


def _rebuilt(program: object, configs: dict[str, dict], payloads: dict[str, bytes]) -> bytes:
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    buffer = io.BytesIO()
    with PT2ArchiveWriter(buffer) as writer:  # writes the format markers itself
        writer.write_bytes(PROGRAM, json.dumps(program).encode("utf-8"))
        for name, tree in configs.items():
            writer.write_bytes(name, json.dumps(tree).encode("utf-8"))
        for path, data in payloads.items():
            writer.write_bytes(path, data)
        writer.write_bytes(SAMPLE_INPUTS, b"")  # torch reads it; empty: no example inputs, nothing unpickled
    return buffer.getvalue()


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" ... ({len(names)} in all)" if len(names) > 5 else "")


def _refused(where: str, why: str) -> CorruptArtifactError:
    return CorruptArtifactError(f"{where} is refused: {why}. A served model holds only its program and raw tensors; "
                                "this file was changed or made by something else. Nothing was loaded from it; export the "
                                "run again (or restore the file from a trusted copy).")

