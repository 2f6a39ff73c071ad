"""Fuzzing (hypothesis) of the two parsers that read what users and other processes write: the run
config (YAML text and `--set` overrides, through `load_config`) and the partition manifest
(`partition/manifest.json`, through `fedpipe.run.inputs.load_partition`, what `Run.load_partition` reads with). Whatever they are given, they return a
valid object or raise a FedpipeError (one clear paragraph); any other exception would reach the user
as a traceback. A validation message names the field it is about."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import time
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runs import small_run

from fedpipe.data.partition import make_partition
from fedpipe.errors import ConfigError, FedpipeError
from fedpipe.run.config import RunConfig, load_config
from fedpipe.store.base import Store

# Generated cases per test; 4 tests, so 4 x EXAMPLES cases in all (about 20 s on 2 busy cores).
EXAMPLES = 600
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _section_fields() -> dict[str, list[str]]:
    """section -> every field name it can hold (a union section: the fields of all its members)."""
    fields: dict[str, set[str]] = {}
    for section, info in RunConfig.model_fields.items():
        members = typing.get_args(info.annotation) or (info.annotation,)
        names: set[str] = set()
        stack = list(members)
        while stack:
            member = stack.pop()
            if hasattr(member, "model_fields"):
                names |= set(member.model_fields)
            else:
                stack.extend(typing.get_args(member))
        fields[section] = sorted(names)
    return {k: v for k, v in fields.items() if v}


FIELDS = _section_fields()
DOTTED = [f"{section}.{name}" for section, names in FIELDS.items() for name in names]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["auto", "sgd", "fedavg", "dirichlet", "mnist5k", "s3://b/p", "1e-3", "-1", "0", ".inf", "~"]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
keys = st.one_of(st.sampled_from(DOTTED), st.sampled_from(list(FIELDS)), st.text(max_size=15))
sections = st.dictionaries(st.sampled_from([n for names in FIELDS.values() for n in names]) | st.text(max_size=8), values, max_size=4)
trees = st.dictionaries(st.sampled_from(list(FIELDS)) | st.text(max_size=8), sections | values, max_size=4)


def _yaml_text(tree) -> str:
    return yaml.safe_dump(tree, allow_unicode=True)


# one file rewritten by every case (hypothesis cannot use function-scoped tmp_path); removed at exit
_FUZZ_DIR = tempfile.mkdtemp(prefix="fedpipe-fuzz-")
atexit.register(shutil.rmtree, _FUZZ_DIR, ignore_errors=True)
CONFIG_FILE = Path(_FUZZ_DIR) / "config.yaml"


@FUZZ
@given(st.one_of(trees.map(_yaml_text), st.text(max_size=200), st.binary(max_size=100).map(lambda b: b.decode("latin-1"))))
def test_any_yaml_text_gives_a_config_or_a_config_error(text):
    CONFIG_FILE.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        load_config(CONFIG_FILE)
    except ConfigError as e:
        assert str(e).strip()


@FUZZ
@given(st.lists(st.tuples(keys, st.one_of(values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()), st.text(max_size=30))), max_size=4),
       st.lists(st.text(max_size=30), max_size=2))
def test_any_overrides_give_a_config_or_a_config_error(assignments, raw):
    try:
        load_config(None, [f"{k}={v}" for k, v in assignments] + raw)
    except ConfigError as e:
        assert str(e).strip()


@FUZZ
@given(st.sampled_from(DOTTED), values)
def test_a_bad_value_is_reported_under_its_field_name(field, value):
    text = yaml.safe_dump(value, default_flow_style=True).strip().replace("\n", " ")
    try:
        load_config(None, [f"{field}={text}"])
    except ConfigError as e:
        message = str(e)
        if message.startswith("The configuration is invalid"):
            section, name = field.split(".")
            assert section in message, message
            # a field that does not belong to the chosen method or scheme is reported as unknown, by name
            assert name in message or "scheme" in message or "method" in message, message


# --- the partition manifest ------------------------------------------------------------------------


class MemoryStore(Store):
    """A dict standing in for the store, so thousands of cases need no disk writes."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def put(self, key, data):
        self.objects[key] = bytes(data)

    def get(self, key):
        return self.objects[key]

    def exists(self, key):
        return key in self.objects

    def size(self, key):
        return len(self.objects[key]) if key in self.objects else None

    def list(self, prefix=""):
        return sorted(k for k in self.objects if k.startswith(prefix))

    def delete(self, key):
        self.objects.pop(key, None)

    def url(self, key=""):
        return f"memory://{key}"


@pytest.fixture(scope="module")
def manifest_run():
    run = small_run("unused", "data.dataset=digits", "partition.num_clients=3", "partition.scheme=iid")
    run.store = MemoryStore()
    manifest = make_partition(run.bundle, run.cfg.partition, run.cfg.run.seed).to_manifest()
    run.store.put(run.layout.partition_manifest, json.dumps(manifest).encode())
    run.load_partition()  # the untouched manifest loads
    return run, manifest


def _paths(node, prefix=()):
    """Every path into a JSON tree (short lists of indices are sampled, not walked entry by entry)."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i in sorted({0, len(node) - 1} if node else set()):
            yield from _paths(node[i], (*prefix, i))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=5,
)


def _mutate(manifest, path, action, value):
    tree = json.loads(json.dumps(manifest))
    if not path:
        return value
    parent = tree
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if action == "delete":
        del parent[last]
    elif action == "add" and isinstance(parent, dict):
        parent[f"{last}_extra"] = value
    elif action == "bump" and isinstance(parent[last], int) and not isinstance(parent[last], bool):
        parent[last] += 1
    else:
        parent[last] = value
    return tree


def _load(run, data: bytes):
    """The manifest reader on `data` (the reader itself: `Run.load_partition` keeps the first manifest it read)."""
    from fedpipe.run import inputs

    run.store.put(run.layout.partition_manifest, data)
    try:
        inputs.load_partition(run.store, run.layout, run.cfg, run.bundle)
    except FedpipeError as e:
        assert str(e).strip()
        return str(e)
    return None


@FUZZ
@given(st.data())
def test_any_damaged_manifest_gives_a_partition_or_a_fedpipe_error(manifest_run, data):
    run, manifest = manifest_run
    text = json.dumps(manifest)
    kind = data.draw(st.sampled_from(["field", "field", "field", "bytes"]))
    if kind == "bytes":  # cut short, bytes flipped or spliced in: what a disk or a copy does
        raw = bytearray(text.encode())
        cut = data.draw(st.integers(0, len(raw)))
        if data.draw(st.booleans()):
            raw = raw[:cut]
        else:
            raw[cut:cut] = data.draw(st.binary(min_size=1, max_size=8))
        _load(run, bytes(raw))
        return
    path = data.draw(st.sampled_from(list(_paths(manifest))))
    action = data.draw(st.sampled_from(["replace", "delete", "add", "bump"]))
    mutated = _mutate(manifest, path, action if path else "replace", data.draw(json_values))
    message = _load(run, json.dumps(mutated).encode())
    if message is not None and "is not a valid partition manifest" in message and path and action != "add":
        # the message names the part of the manifest that is wrong (or, for whole-manifest checks, what disagrees)
        named = [str(p) for p in path if isinstance(p, str)]
        assert any(n in message for n in named) or "manifest has" in message or "index" in message or "clients" in message, (path, message)



@pytest.mark.parametrize("where", [("clients", 0, "indices", "train", 0), ("seed",), ("clients", 1, "sizes", "test")])
def test_a_number_beyond_int64_in_a_manifest_is_a_named_error_not_an_overflow(manifest_run, where):
    """Found by the fuzz test above in CI: an index of 2**64 reached numpy (OverflowError, a traceback)."""
    run, manifest = manifest_run
    tree = json.loads(json.dumps(manifest))
    parent = tree
    for part in where[:-1]:
        parent = parent[part]
    parent[where[-1]] = 2**64
    message = _load(run, json.dumps(tree).encode())
    assert message and "is not a valid partition manifest" in message and str(where[-1]) in message, message

# --- whole classes of hostile input, not only values: bytes, sizes, aliases, nesting ---------------------

QUICK = 2.0  # seconds: each is refused (or read) in well under one; the margin is for a loaded test machine


def _alias_tree(fanout: int, levels: int, recursive: bool) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * fanout)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fanout)}]" for i in range(1, levels)]
    if recursive:
        lines.append("r: &r [1, *r]")
    return "\n".join(lines) + "\n"


def _nested(depth: int, kind: str) -> str:
    if kind == "flow":
        return "x: " + "[" * depth + "]" * depth + "\n"
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "v: 1\n"


hostile_yaml = st.one_of(
    st.binary(max_size=300),  # any bytes: invalid UTF-8, NULs, control characters
    st.builds(lambda head, tail: head + b"\xff\xfe" + tail, st.binary(max_size=40), st.binary(max_size=40)),
    st.builds(_alias_tree, st.integers(1, 12), st.integers(1, 12), st.booleans()).map(str.encode),
    st.builds(_nested, st.integers(1, 900), st.sampled_from(["flow", "block"])).map(str.encode),
    st.builds(lambda n, item: b"x: [" + item * n + b"1]\n", st.integers(0, 30_000), st.sampled_from([b"1, ", b"[], ", b"{}, "])),
    st.builds(lambda scalar: b"run: {seed: " + scalar.encode() + b"}\n",
              st.sampled_from(["1" * 5000, "2001-13-01", "2001-02-30 25:61:61", "!!binary zz", "!!python/object:os.system x", "0x" + "f" * 5000,
                               "1e99999", ".nan", "&a 1", "*b", "!!set {a, b}", "!!omap [a: 1]", "\ufeff1"])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_yaml)
def test_hostile_config_bytes_give_a_config_error_quickly(data):
    CONFIG_FILE.write_bytes(data)
    start = time.perf_counter()
    try:
        load_config(CONFIG_FILE)
    except ConfigError as e:  # a problem with the file itself names the file
        assert str(e).startswith("The configuration is invalid") or str(CONFIG_FILE) in str(e), str(e)[:300]
    assert time.perf_counter() - start < QUICK


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_yaml.map(lambda b: b.decode("utf-8", "replace")))
def test_hostile_set_values_give_a_config_or_a_config_error_quickly(text):
    start = time.perf_counter()
    try:
        load_config(None, [f"partition.label_families={text}"])
    except ConfigError as e:
        assert str(e).strip()
    assert time.perf_counter() - start < QUICK


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_hostile_manifest_bytes_give_a_fedpipe_error_quickly(manifest_run, data):
    run, manifest = manifest_run
    text = json.dumps(manifest).encode()
    kind = data.draw(st.sampled_from(["bytes", "nested", "padded", "utf8"]))
    if kind == "bytes":
        raw = data.draw(st.binary(max_size=300))
    elif kind == "nested":
        depth = data.draw(st.integers(1, 5_000))
        raw = b'{"clients": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "padded":  # the real manifest followed by whitespace: a size well past what a digits split can be
        raw = text + b" " * data.draw(st.sampled_from([1, 1 << 20, 8 << 20]))
    else:
        cut = data.draw(st.integers(0, len(text)))
        raw = text[:cut] + data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + text[cut:]
    start = time.perf_counter()
    message = _load(run, raw)
    assert time.perf_counter() - start < QUICK
    if kind != "padded" or len(raw) > 2 * len(text) + (4 << 20):
        assert message is not None and run.store.url(run.layout.partition_manifest) in message, message
