"""`fedpipe models` and `fedpipe predict`: model lines, their versions, and a quick prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe.cli.common import ConfigOpt, SetOpt, _guarded, _load, app
from fedpipe.errors import FedpipeError

models_app = typer.Typer(
    help="Model lines: the versions of a model in the store (models/<name>/), each one run's models exported for serving "
         "(the global model and every client's personalized model) with its record: run id, config, data snapshot, "
         "accuracy and the gate's decision. One version is promoted: what `fedpipe predict` and warm starts "
         "(train.init_from=promoted) use. `list` and `show` read; `promote` and `rollback` move the pointer by hand, "
         "each move recorded in the line's history.",
    no_args_is_help=True,
)
app.add_typer(models_app, name="models")
LineArg = Annotated[str, typer.Argument(metavar="NAME", help="The model line: registry.name of the runs that register into it.")]
LineStoreOpt = Annotated[Optional[str], typer.Option("--store", help="The store holding the model line: a folder or s3://bucket/prefix (default: run.store of --config / --set, else runs/).")]


def _model_line(name: str, store: Optional[str], config: Optional[Path], overrides: Optional[list[str]]):
    """The line NAME in the store; a line that is not there is an error naming the lines that are."""
    from fedpipe.models.line import ModelLine, line_names
    from fedpipe.store import open_store

    line = ModelLine(open_store(store if store is not None else _load(config, overrides).run.store), name)
    if not line.exists():
        lines = line_names(line.store)
        there = f"the lines there: {', '.join(lines[:20])}" if lines else "there is no model line there yet (a run with registry.name=NAME registers one)"
        raise FedpipeError(f"No model line {name!r} in {line.store.url()}; {there}. Pass --store (or --config / --set "
                           "run.store=...) if the line lives in another store.")
    return line


def _line_and_version(ref: str, store, config, overrides, *, default_latest: bool):
    """NAME or NAME@VERSION: the line, and the version (given, else the promoted one, else with
    `default_latest` the newest)."""
    name, _, given = ref.partition("@")
    line = _model_line(name, store, config, overrides)
    if given:
        if not given.isdigit() or int(given) < 1:
            raise FedpipeError(f"{ref!r}: the version after '@' is a number 1, 2, ... (`fedpipe models list {name}`).")
        versions = line.versions()
        if int(given) not in versions:
            there = (f"its versions are {_ranges(versions)}" if versions else "it has no registered version yet")
            raise FedpipeError(f"Model line {name!r} has no version {int(given)}; {there} (`fedpipe models list {name}`).")
        return line, int(given)
    version = line.promoted()
    if version is None and default_latest and line.versions():
        version = line.versions()[-1]
    if version is None:
        raise FedpipeError(f"Model line {name!r} in {line.store.url()} has no promoted version: name one as {name}@VERSION "
                           f"(`fedpipe models list {name}`), or promote one (`fedpipe models promote {name} VERSION`).")
    return line, version


def _ranges(numbers: list[int]) -> str:
    """1, 2, 3, 5, 7, 8 -> '1-3, 5, 7-8' (a line's versions, said short)."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _promoted_or_warn(line) -> Optional[int]:
    """The promoted version; a bad pointer is said (on stderr) and shown as none, so the versions can still be listed."""
    from fedpipe.errors import CorruptArtifactError

    try:
        return line.promoted()
    except CorruptArtifactError as e:
        typer.echo(f"warning: {e}", err=True)
        return None


def _accuracy(summary: dict) -> str:
    pers, glob = summary.get("personalized_accuracy"), summary.get("global_model")
    mean = pers.get("mean") if isinstance(pers, dict) else None
    top1 = glob.get("top1") if isinstance(glob, dict) else None
    shown = lambda x: f"{100 * x:.2f}%" if isinstance(x, (int, float)) else "n/a"  # noqa: E731
    return f"personalized {shown(mean)}  global {shown(top1)}"


def _snapshot(snapshot: Optional[dict]) -> str:
    if not snapshot:
        return "bundled data"
    return f"{str(snapshot.get('digest', '?'))[:12]} ({snapshot.get('objects', '?')} objects)"


@models_app.command("list")
@_guarded
def models_list(name: LineArg, store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """List a line's versions, oldest first: accuracy (the clients' mean personalized accuracy and the global
    model's, on their test splits), the data snapshot the run read, the gate's decision; * marks the promoted one."""
    line = _model_line(name, store, config, set)
    versions = line.versions()
    if not versions:
        typer.echo(f"model line {name} in {line.store.url()}: no versions yet (a run with registry.name={name} registers one)")
        return
    promoted = _promoted_or_warn(line)
    typer.echo(f"model line {name} in {line.store.url()}: {len(versions)} version(s), promoted: {promoted or 'none'}")
    from fedpipe.models.line import abandoned

    for n, claim in abandoned(line):
        typer.echo(f"  v{n:<4} claimed {claim.get('time', '?')} by run {claim.get('run_id', '?')} but never registered (a "
                   f"registration that died, or one still writing): `fedpipe models clean {name}` removes its files", err=True)
    for v in versions:
        r = line.record(v)
        decision = r.decision.get("reason") or ("promoted" if r.decision.get("promoted") else "no decision recorded")
        typer.echo(f"{'*' if v == promoted else ' '} v{v:<4} {r.created:<25} {_accuracy(r.summary)}  data {_snapshot(r.data_snapshot)}  "
                   f"run {r.run_id}  gate: {decision}")


@models_app.command("show")
@_guarded
def models_show(ref: Annotated[str, typer.Argument(metavar="NAME[@VERSION]", help="The line, and a version (default: the promoted one, else the newest).")],
                store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Show one version: its record (run, method, model, data, accuracy, the gate's decision), its clients and
    the files a server loads (spec.json says how to feed them), and the line's promotion history."""
    import json

    line, version = _line_and_version(ref, store, config, set, default_latest=True)
    r = line.record(version)
    promoted = _promoted_or_warn(line)
    typer.echo(f"model line {line.name}, version {version}{' (promoted)' if version == promoted else ''}, created {r.created}")
    typer.echo(f"  run          {r.run_id}")
    typer.echo(f"  model        {r.spec.model} ({r.spec.method}), input {'x'.join(map(str, r.spec.input_shape))}, "
               f"{r.spec.num_classes} classes")
    typer.echo(f"  accuracy     {_accuracy(r.summary)}")
    typer.echo(f"  data         {_snapshot(r.data_snapshot)}{'  ' + str(r.data_snapshot.get('source')) if r.data_snapshot else ''}")
    typer.echo(f"  gate         {json.dumps(r.decision) if r.decision else 'no decision recorded'}")
    shown = ", ".join(r.clients[:10]) + (f", ... ({len(r.clients)} in all)" if len(r.clients) > 10 else "")
    typer.echo(f"  clients      {shown or 'none'}")
    folder = line.keys.version(version)
    for key in line.store.list(folder):
        typer.echo(f"  file         {key[len(folder):]:<40} {line.store.size(key) or 0:>12,} bytes")
    for entry in line.history()[-10:]:
        typer.echo(f"  history      #{entry['seq']} {entry['time']} {entry['action']} v{entry['version']}: {entry['reason']}")


@models_app.command("clean")
@_guarded
def models_clean(name: LineArg, older_than_hours: Annotated[float, typer.Option(min=0, help="Only numbers claimed longer ago than this (a registration still writing is younger).")] = 1.0,
                 store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Remove the files of version numbers that were claimed but never registered (a registration that crashed
    between taking its number and writing its record). Registered versions are never touched."""
    line = _model_line(name, store, config, set)
    from fedpipe.models.line import remove_abandoned

    removed = remove_abandoned(line, older_than_hours * 3600)
    typer.echo(f"model line {name}: removed the files of {len(removed)} abandoned number(s)"
               + (f": {', '.join(f'v{n}' for n in removed)}" if removed else ""))


@models_app.command("regate")
@_guarded
def models_regate(ref: Annotated[str, typer.Argument(metavar="NAME@VERSION", help="The line and the version to decide on again.")],
                  store: LineStoreOpt = None, set: SetOpt = None):
    """Decide again whether a registered version should be promoted, without retraining: the gate scores its run's
    models against the promoted version under the version's registry settings with --set registry.*=... applied
    (e.g. after a rerun reported a registration made under other settings, or after a flagged drop was checked by
    hand). A promotion is recorded in the line's history; the version's record is never rewritten."""
    from fedpipe.models.publish import regate

    if "@" not in ref:
        raise FedpipeError(f"{ref!r}: name the version as NAME@VERSION (`fedpipe models list {ref}`).")
    line, version = _line_and_version(ref, store, None, None, default_latest=False)
    result = regate(line, version, list(set or []))
    verdict = "promoted" if result["changed"] else ("already promoted" if result["promoted"] else "not promoted")
    typer.echo(f"model line {line.name}, version {version}: {verdict}: {result['reason']}")


@models_app.command("promote")
@_guarded
def models_promote(name: LineArg, version: Annotated[int, typer.Argument(min=1, help="The version to promote (`fedpipe models list NAME`).")],
                   reason: Annotated[str, typer.Option(help="Why, for the history (shown by `fedpipe models show`).")] = "promoted by hand",
                   store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Promote a version by hand, whatever the gate decided: `fedpipe predict` and warm starts use it from now on.
    Of two promotions made at once one wins and the other changes nothing and says so."""
    line = _model_line(name, store, config, set)
    before = line.log.pointer()
    line.promote(version, reason)
    typer.echo(f"model line {name}: version {version} promoted (was {before.version if before else 'none'})")


@models_app.command("rollback")
@_guarded
def models_rollback(name: LineArg, store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Promote again the version promoted before the current one (per the history; rolling back twice goes two
    promotions back). Its record must be unchanged since it was promoted."""
    line = _model_line(name, store, config, set)
    current = line.log.pointer()
    version = line.rollback()
    typer.echo(f"model line {name}: version {version} promoted again (rolled back from {current.version if current else 'none'})")


@app.command()
@_guarded
def predict(files: Annotated[list[Path], typer.Argument(metavar="FILES...", help="Images (PNG, JPEG) for an image model; CSV files of raw feature rows for a table model.")],
            model: Annotated[str, typer.Option("--model", help="NAME or NAME@VERSION of a model line (default version: the promoted one).")],
            client: Annotated[Optional[str], typer.Option("--client", help="The client whose personalized model predicts: its name for data with its own clients (a site), else its number. Default: the global model.")] = None,
            trust_unsigned: Annotated[bool, typer.Option("--trust-unsigned", help="Read a model line without signatures (FEDPIPE_SIGNING_KEY unset): only if you trust everyone who can write its store. A .pt2 holding pickled code, and TorchScript, are refused all the same.")] = False,
            store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Predict with an exported model, as a server would: only torch loads it (torch.export's .pt2, or TorchScript),
    and it takes raw inputs (the normalisation the run applied is inside it). Prints `file  label  probability`
    per image, or per CSV row (file:line). The line must be signed (FEDPIPE_SIGNING_KEY, the key its runs signed
    with) unless --trust-unsigned; a .pt2 is checked to hold no pickle and no code before torch loads it, and
    TorchScript is loaded from a signed line only. Examples:

        fedpipe predict --model sites --client hospital-a scan1.png scan2.png

        fedpipe predict --model credit@3 --client branch-2 --store s3://mlpipeline/fedpipe rows.csv
    """
    import torch

    from fedpipe.models.export import MAX_SERVED_MODEL_BYTES, MAX_SPEC_BYTES, SPEC_FILE, ServingSpec, load_exported, read_inputs

    line, version = _line_and_version(model, store, config, set, default_latest=False)
    signed = _signed_or_trusted(line, trust_unsigned)
    spec = ServingSpec.from_bytes(line.read(version, SPEC_FILE, MAX_SPEC_BYTES), line.store.url(line.keys.version(version) + SPEC_FILE))
    served = spec.served(client)
    where = line.store.url(line.keys.version(version) + served.file)
    size = line.store.size(line.keys.version(version) + served.file) or 0
    if size > MAX_SERVED_MODEL_BYTES:
        raise FedpipeError(f"{where} is {size / 2**30:.1f} GiB; predict reads a model whole and takes at most "
                           f"{MAX_SERVED_MODEL_BYTES // 2**30} GiB. Serve it with torch.export.load on a machine sized for it.")
    net = load_exported(line.read(version, served.file, MAX_SERVED_MODEL_BYTES), served.format, where, signed=signed)
    names, x = read_inputs(spec, [str(f) for f in files])
    with torch.no_grad():
        probs = torch.softmax(net(x).double(), dim=1)
    best, index = probs.max(dim=1)
    width = max(len(n) for n in names)
    for row, p, i in zip(names, best.tolist(), index.tolist()):
        label = spec.labels[i] if i < len(spec.labels) else str(i)
        typer.echo(f"{row:<{width}}  {label}  {p:.4f}")


def _signed_or_trusted(line, trust_unsigned: bool) -> bool:
    """Whether the line's objects are verified against the signing key; an unsigned line is refused unless the
    user trusts whoever can write its store (--trust-unsigned)."""
    import os

    from fedpipe.store.signed import ENV_ALLOW_UNSIGNED, ENV_SIGNING_KEY, ENV_SIGNING_KEY_FILE, verifies_signatures

    if verifies_signatures(line.store) or trust_unsigned:
        return verifies_signatures(line.store)
    why = (f"{ENV_ALLOW_UNSIGNED} lets unsigned objects through" if os.environ.get(ENV_ALLOW_UNSIGNED)
           else f"neither {ENV_SIGNING_KEY} nor {ENV_SIGNING_KEY_FILE} is set")
    raise FedpipeError(
        f"Model line {line.name!r} in {line.store.url()} is read without signature checks ({why}), so anyone who can "
        f"write that store could have replaced its models, and predict refuses it. Set {ENV_SIGNING_KEY} (or "
        f"{ENV_SIGNING_KEY_FILE}) to the key the line's runs signed with; or, if you trust everyone who can write "
        "that store, pass --trust-unsigned.")
