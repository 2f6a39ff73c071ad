"""Reading what a user (or another program) hands fedpipe, within bounds.

Every text file fedpipe parses that it did not just compute itself (the run config, a `--set`
value, the partition manifest, the run record) goes through one of these functions. Each refuses,
with one clear paragraph naming the file, and in well under a second:

- a file larger than its size cap (checked before the bytes are read when the size is known);
- bytes that are not UTF-8 (the message gives the byte offset) or binary content (a NUL byte);
- nesting deeper than a depth cap (PyYAML's composer and Python's json recurse: a few thousand
  brackets would otherwise end in a RecursionError);
- YAML aliases that expand the document beyond what its size cap allows (a "billion laughs" config
  of nested aliases is a few hundred bytes of text and billions of nodes once something walks it)
  and recursive aliases (a node that contains itself);
- any value the YAML or JSON constructors reject with a plain Python exception (a 5,000-digit
  integer, a date like 2001-13-01): reported as bad content, never as a traceback.

YAML is parsed twice: first as a stream of events (libyaml's C parser when PyYAML has it), which is
flat, so nesting and alias expansion are measured without recursion and without building
anything; only a document within bounds is then constructed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fedpipe.errors import ConfigError, FedpipeError

# --- limits ------------------------------------------------------------------------------------------

#: A run config: the examples are under 1 KB and a config with every field written out and commented
#: is about 15 KB. 64 KiB leaves room for long comments and lists while keeping the worst case (a
#: file of nothing but tiny nodes) well under a second to parse, even with PyYAML's pure-Python
#: constructor.
MAX_CONFIG_BYTES = 64 * 2**10

#: Nodes a YAML document may hold once its aliases are expanded. An alias-free document within
#: MAX_CONFIG_BYTES holds at most about MAX_CONFIG_BYTES / 2 nodes ("1," per node), so aliases may
#: save typing but cannot make a document bigger than its size cap already allows.
MAX_YAML_NODES = MAX_CONFIG_BYTES // 2 + 1024

#: Nesting of a config: section -> field -> list -> list (label_families) is 4 levels.
MAX_YAML_DEPTH = 32

#: Nesting of fedpipe's JSON artifacts: the run record's config is 4-5 levels, the manifest 4.
MAX_JSON_DEPTH = 32

#: The run record (<run>/run.json): a run id, a fingerprint and one config (a few KB), whose own
#: YAML source was capped at MAX_CONFIG_BYTES.
MAX_RECORD_BYTES = 16 * MAX_CONFIG_BYTES

#: The partition manifest: a fixed head (the scheme, the dataset's fingerprint), per client a few
#: hundred bytes plus one count per class, and every sample index at most once (once per client that
#: holds it for schemes whose clients share samples). See `manifest_byte_limit`.
MANIFEST_HEAD_BYTES = 2**20
MANIFEST_BYTES_PER_CLIENT = 1024
MANIFEST_BYTES_PER_COUNT = 24  # a label count or an index: up to 20 digits and ", "


def manifest_byte_limit(pool_size: int, num_clients: int, num_classes: int, indices: int | None = None) -> int:
    """The largest partition manifest a dataset of `pool_size` training rows split over `num_clients`
    clients can produce (`indices`: how many sample indices the clients hold in all, when samples can
    be shared; else at most the pool), with a factor of 2 to spare. A manifest of 5,000 rows over
    100 clients is allowed about 3 MB; the real one is about 40 KB."""
    entries = max(pool_size, indices or 0) + num_clients * num_classes
    return 2 * (MANIFEST_HEAD_BYTES + num_clients * MANIFEST_BYTES_PER_CLIENT + entries * MANIFEST_BYTES_PER_COUNT)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} bytes"


# --- bytes -> text -----------------------------------------------------------------------------------


def check_size(size: int, limit: int, where: str, what: str, error: type[FedpipeError] = ConfigError, advice: str = "Check the path.") -> None:
    if size > limit:
        raise error(f"{where} is {_size(size)}, more than the {_size(limit)} a {what} can be: it is not a {what}, "
                    f"or it was damaged. {advice}")


def decode_text(data: bytes, where: str, what: str, error: type[FedpipeError] = ConfigError) -> str:
    """UTF-8 text (a leading byte-order mark is dropped), or `error` naming the file and the first bad byte."""
    if b"\x00" in data:
        at = data.index(b"\x00")
        raise error(f"{where} is binary, not a {what}: it holds a NUL byte at byte offset {at}. Pass the {what} "
                    "itself (a UTF-8 text file).")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{where} is not UTF-8 text: byte offset {e.start} holds {data[e.start:e.start + 1]!r}, which "
                    f"UTF-8 does not allow there ({e.reason}). Save the {what} as UTF-8.") from None


def read_file(path: str | Path, limit: int, what: str, error: type[FedpipeError] = ConfigError) -> str:
    """A local text file within `limit` bytes, decoded (the size is checked before reading)."""
    p = Path(path)
    try:
        check_size(p.stat().st_size, limit, str(p), what, error)
        with p.open("rb") as f:
            data = f.read(limit + 1)  # a file that grows after the stat is still cut at the cap
    except OSError as e:
        raise error(f"Cannot read {what} {p}: {e.strerror or e}.") from None
    check_size(len(data), limit, str(p), what, error)
    return decode_text(data, str(p), what, error)


# --- YAML --------------------------------------------------------------------------------------------

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _measure_yaml(text: str, where: str, what: str, max_nodes: int = MAX_YAML_NODES) -> None:
    """Walk the event stream: refuse nesting deeper than MAX_YAML_DEPTH and documents whose aliases
    expand beyond MAX_YAML_NODES nodes (or refer to a node from inside it)."""
    sizes: dict[str, int] = {}  # anchor -> expanded node count of the finished node
    open_: list[list] = []  # [expanded size so far, anchor] per open collection
    total = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(open_) >= MAX_YAML_DEPTH:
                raise ConfigError(f"{where} nests deeper than {MAX_YAML_DEPTH} levels (line {event.start_mark.line + 1}); "
                                  f"a {what} is a few levels deep. Check the brackets and the indentation.")
            open_.append([1, event.anchor])
            continue
        if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            n, anchor = open_.pop()
        elif isinstance(event, yaml.ScalarEvent):
            n, anchor = 1, event.anchor
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                if any(a == event.anchor for _, a in open_):
                    raise ConfigError(f"{where}: the alias *{event.anchor} (line {event.start_mark.line + 1}) refers to a "
                                      f"node that contains it, which would never end. Write the value out.")
                raise ConfigError(f"{where}: the alias *{event.anchor} (line {event.start_mark.line + 1}) names no anchor "
                                  f"defined before it.")
            n, anchor = sizes[event.anchor], None
        else:
            continue
        if anchor is not None:
            sizes[anchor] = n
        if open_:
            open_[-1][0] += n
        else:
            total += n
        if n > max_nodes or total > max_nodes or (open_ and open_[-1][0] > max_nodes):
            raise ConfigError(f"{where}: its YAML aliases expand to more than {max_nodes:,} values (line "
                              f"{event.start_mark.line + 1}); a {what} holds a few hundred. Write the values out "
                              "instead of nesting aliases.")


def parse_yaml(text: str, where: str, what: str = "config", *, invalid_is_text: bool = False,
               max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """Parse YAML text within MAX_CONFIG_BYTES, MAX_YAML_DEPTH and MAX_YAML_NODES; any problem is a
    ConfigError naming `where`. With `invalid_is_text` (a `--set` value), text that is not valid YAML
    (or holds a value YAML cannot construct, such as the date 2001-13-01) is returned as the string
    itself; exceeding a bound is still an error."""
    check_size(len(text.encode("utf-8", "surrogatepass")), max_bytes, where, what)
    try:
        _measure_yaml(text, where, what, max(MAX_YAML_NODES, max_bytes // 2 + 1024))  # a node takes 2 bytes at least
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a safe loader: plain data only)
    except yaml.YAMLError as e:
        if invalid_is_text:
            return text
        raise ConfigError(f"{where} is not valid YAML: {e}") from None
    except (ValueError, TypeError, OverflowError) as e:  # a constructor's own check (int digits, dates)
        if invalid_is_text:
            return text
        raise ConfigError(f"{where} holds a value YAML cannot represent: {e}.") from None


def load_yaml_file(path: str | Path, what: str = "config") -> Any:
    """A YAML file within MAX_CONFIG_BYTES, UTF-8, parsed within bounds. Raises ConfigError."""
    return parse_yaml(read_file(path, MAX_CONFIG_BYTES, what), f"{what.capitalize()} file {path}", what)


# --- JSON --------------------------------------------------------------------------------------------


def _check_json_depth(tree: Any, where: str, what: str, error: type[FedpipeError]) -> None:
    # Only containers go on the stack: a partition manifest's 640,000 sample indices were each pushed
    # and popped (a second of a 10,000-client run).
    stack = [(tree, 1)] if isinstance(tree, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise error(f"{where} is not a valid {what}: it nests deeper than {MAX_JSON_DEPTH} levels.")
        children = node.values() if isinstance(node, dict) else node
        stack.extend([(child, depth + 1) for child in children if isinstance(child, (dict, list))])


def parse_json(data: bytes, where: str, what: str, limit: int, error: type[FedpipeError], advice: str = "") -> Any:
    """JSON bytes within `limit` and MAX_JSON_DEPTH, UTF-8; any problem is `error` naming `where`
    (and ending with `advice`)."""
    tail = f" {advice}" if advice else ""
    check_size(len(data), limit, where, what, error, advice)
    try:
        text = decode_text(data, where, what, error)
        try:
            tree = json.loads(text)
        except RecursionError:
            raise error(f"{where} is not a valid {what}: it nests deeper than {MAX_JSON_DEPTH} levels.") from None
        except ValueError as e:  # JSONDecodeError, or an integer of too many digits
            raise error(f"{where} is not a valid {what}: {str(e).splitlines()[0]}.") from None
        _check_json_depth(tree, where, what, error)
    except FedpipeError as e:
        raise error(f"{e}{tail}") from None
    return tree


def read_store_json(store, key: str, what: str, limit: int, error: type[FedpipeError], advice: str = "") -> Any:
    """A JSON value from the artifact store within bounds (its size checked before it is fetched)."""
    where = store.url(key)
    known = store.size(key)
    if known is not None:
        check_size(known, limit, where, what, error, advice)
    return parse_json(store.get(key), where, what, limit, error, advice)
