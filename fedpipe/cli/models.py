"""`fedpipe models` and `fedpipe predict`: model lines, their versions, and a quick prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fedpipe import __version__
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


def _privacy(record) -> str:
    """A version's privacy in a few words: epsilon at delta from its ledger (a record made before records kept one:
    from its summary), or "not private"."""
    ledger = record.privacy
    if ledger is not None:
        epsilon, delta, rounds, inherited = ledger.epsilon(), ledger.delta, ledger.rounds, ledger.inherited_rounds
    else:
        told = record.summary.get("privacy")
        figures = (told.get("epsilon"), told.get("delta")) if isinstance(told, dict) else (None, None)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in figures):
            return "not private"
        (epsilon, delta), rounds, inherited = figures, None, 0
    if epsilon == float("inf"):
        return f"not private (epsilon infinite at delta {delta:.3g}: trained without noise)"
    shown = f"epsilon {epsilon:.3f} at delta {delta:.3g}"
    if rounds is None:
        return shown + " (from its summary)"
    return shown + f" ({ledger.kind}, {rounds} private rounds" + (f", {inherited} of them inherited" if inherited else "") + ")"


def _snapshot(snapshot: Optional[dict]) -> str:
    if not snapshot:
        return "bundled data"
    return f"{str(snapshot.get('digest', '?'))[:12]} ({snapshot.get('objects', '?')} objects)"


@models_app.command("list")
@_guarded
def models_list(name: LineArg, store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """List a line's versions, oldest first: accuracy (the clients' mean personalized accuracy and the global
    model's, on their test splits), the data snapshot the run read, its epsilon and delta (or "not private"), the
    gate's decision; * marks the promoted one."""
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
    moved = {e["version"]: e for e in _history_or_none(line)}  # each version's latest promotion or rollback
    for v in versions:
        r = line.record(v)
        typer.echo(f"{'*' if v == promoted else ' '} v{v:<4} {r.created:<25} {_accuracy(r.summary)}  data {_snapshot(r.data_snapshot)}  "
                   f"{_privacy(r).partition(' (')[0]}  run {r.run_id}  {_gate_said(r.decision, moved.get(v))}")


def _history_or_none(line) -> list[dict]:
    """The line's history; a damaged pointer or entry (said by `_promoted_or_warn`) shows as none."""
    from fedpipe.errors import CorruptArtifactError

    try:
        return line.history()
    except CorruptArtifactError:
        return []


def _gate_said(decision: dict, moved: Optional[dict]) -> str:
    """A version's gate decision for `models list`; for a version the gate refused that was promoted (or rolled back
    to) since, that history entry first, so a promoted version never reads as only "not promoted"."""
    said = decision.get("reason") or ("promoted" if decision.get("promoted") else "no decision recorded")
    if moved is None or decision.get("promoted") is not False:
        return f"gate: {said}"
    from fedpipe.models.line import REGATED

    how = ("regated" if moved["reason"].startswith(REGATED) else
           "rolled back to by hand" if moved["action"] == "rollback" else "promoted by hand")
    return f"{how} (history #{moved['seq']} {moved['time']}: {moved['reason']}); gate at registration: {said}"


@models_app.command("show")
@_guarded
def models_show(ref: Annotated[str, typer.Argument(metavar="NAME[@VERSION]", help="The line, and a version (default: the promoted one, else the newest).")],
                store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Show one version: its record (run, method, model, data, accuracy, the gate's decision), its privacy (epsilon
    and delta of its global model, counting the versions it was warm-started from, and what the guarantee does not
    cover), its clients and the files a server loads (spec.json says how to feed them), and the line's promotion history."""
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
    privacy = _privacy(r)
    typer.echo(f"  privacy      {privacy}")
    sources = r.privacy.sources if r.privacy is not None else []
    if len(sources) > 10:
        typer.echo(f"  inherited    ... {len(sources) - 10} earlier version(s)")
    for source in sources[-10:]:
        typer.echo(f"  inherited    {source['rounds']} rounds from {source['from']}")
    if not privacy.startswith("not private") and r.clients:
        typer.echo("  NOT covered  the guarantee covers the global model the server released, not this version's personalized "
                   "models (clients/, and the client states in state.pt): each is its client's own model, trained on its own "
                   "data without noise, and stored here in the model line by the server. Anyone who can read this line can "
                   "read them; serve or share them as that client's data.")
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
    said = result["reason"]
    for prefix in ("promoted: ", "not promoted: "):  # the decision's own reason opens with its verdict: said once
        said = said.removeprefix(prefix)
    typer.echo(f"model line {line.name}, version {version}: {verdict}: {said}")
    if "context" in result:
        typer.echo(f"  decided      {result['context']}")


@models_app.command("promote")
@_guarded
def models_promote(name: LineArg, version: Annotated[int, typer.Argument(min=1, help="The version to promote (`fedpipe models list NAME`).")],
                   reason: Annotated[str, typer.Option(help="Why, for the history (shown by `fedpipe models show`).")] = "promoted by hand",
                   force: Annotated[bool, typer.Option("--force", help="Promote a version the gate refused (its record says why).")] = False,
                   store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None):
    """Promote a version by hand: `fedpipe predict` and warm starts use it from now on. A version the gate refused
    is promoted only with --force (the refusal is said, and recorded in the history); `fedpipe models regate` decides
    again instead. Of two promotions made at once one wins and the other changes nothing and says so."""
    from fedpipe.models.line import MAX_REASON_CHARS, refusal

    line = _model_line(name, store, config, set)
    before = line.log.pointer()
    why = refusal(line, version) if version in line.versions() else ""
    if why and force:
        typer.echo(f"warning: the gate refused version {version} at registration ({why}); promoting it by hand (--force).", err=True)
        reason = f"{reason} (--force, over the gate's refusal: {why})"[:MAX_REASON_CHARS]
    line.promote(version, reason, over_refusal=force)
    typer.echo(f"model line {name}: version {version} promoted (was {before.version if before else 'none'})")


@models_app.command("rollback")
@_guarded
def models_rollback(name: LineArg, store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None,
                    force: Annotated[bool, typer.Option("--force", help="Roll back to a version the gate refused (promoted by hand before).")] = False):
    """Promote again the version promoted before the current one (per the history; rolling back twice goes two
    promotions back). Its record must be unchanged since it was promoted. A version the gate refused (promoted by
    hand before) is rolled back to only with --force."""
    line = _model_line(name, store, config, set)
    current = line.log.pointer()
    from fedpipe.models.line import refusal

    version = line.rollback(over_refusal=force)
    if why := refusal(line, version):
        typer.echo(f"warning: the gate refused version {version} at registration ({why}); rolled back to it by hand (--force).",
                   err=True)
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
    TorchScript is loaded from a signed line only. Images are decoded within the decode budget the data readers
    use (data.max_decoded_mb, auto unless --config or --set gives it): an image that would take more is refused
    by name. Examples:

        fedpipe predict --model sites --client hospital-a scan1.png scan2.png

        fedpipe predict --model credit@3 --client branch-2 --store s3://mlpipeline/fedpipe rows.csv
    """
    import torch

    from fedpipe.data.files.budget import DecodeBudget
    from fedpipe.models.export import MAX_SERVED_MODEL_BYTES, MAX_SPEC_BYTES, SPEC_FILE, ServingSpec, load_exported, read_inputs
    from fedpipe.serving.predictor import signed_or_trusted

    line, version = _line_and_version(model, store, config, set, default_latest=False)
    signed = signed_or_trusted(line, trust_unsigned)
    spec = ServingSpec.from_bytes(line.read(version, SPEC_FILE, MAX_SPEC_BYTES), line.store.url(line.keys.version(version) + SPEC_FILE))
    served = spec.served(client)
    where = line.store.url(line.keys.version(version) + served.file)
    size = line.store.size(line.keys.version(version) + served.file) or 0
    if size > MAX_SERVED_MODEL_BYTES:
        raise FedpipeError(f"{where} is {size / 2**30:.1f} GiB; predict reads a model whole and takes at most "
                           f"{MAX_SERVED_MODEL_BYTES // 2**30} GiB. Serve it with torch.export.load on a machine sized for it.")
    net = load_exported(line.read(version, served.file, MAX_SERVED_MODEL_BYTES), served.format, where, signed=signed)
    budget = DecodeBudget(_load(config, set).data.max_decoded_mb if config is not None or set else "auto")
    names, x = read_inputs(spec, [str(f) for f in files], budget)
    with torch.no_grad():
        probs = torch.softmax(net(x).double(), dim=1)
    best, index = probs.max(dim=1)
    width = max(len(n) for n in names)
    for row, p, i in zip(names, best.tolist(), index.tolist()):
        label = spec.labels[i] if i < len(spec.labels) else str(i)
        typer.echo(f"{row:<{width}}  {label}  {p:.4f}")


@models_app.command("serve", epilog="""Example (in another terminal, once it says it is listening):

    curl -s localhost:8080/v2/models/sites/infer -H 'Content-Type: application/json' -d '{"parameters": {"client": "hospital-a"}, "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0, 0, 80, 255, 160, 0, 0, 0, 0, 0, 240, 96, 255, 64, 0, 0, 0, 48, 255, 0, 176, 128, 0, 0, 0, 64, 192, 0, 0, 128, 0, 0, 0, 80, 128, 0, 0, 144, 0, 0, 0, 64, 176, 0, 16, 192, 0, 0, 0, 32, 224, 80, 192, 96, 0, 0, 0, 0, 96, 240, 160, 0, 0, 0]}]}'

The answer holds "probabilities" (per label, in spec.json's label order), "label" (the best label's name) and "label_index", and says which version and model answered (parameters: version, model, client). The client can go in the Fedpipe-Client header instead; v1 works too: POST /v1/models/sites:predict with {"instances": [[[...8x8 pixels...]]], "parameters": {"client": "hospital-a"}}. GET /v2/models/sites says the input's shape and datatype; /metrics shows fedpipe_serving_cached_models. /v2/health/ready answers 503 unless the model is ready to answer; the model repository extension (POST /v2/repository/models/NAME/load or unload) is refused with 403: promote a version to change what is served. The Fedpipe-Client header is read as UTF-8.""")
@_guarded
def models_serve(ref: Annotated[str, typer.Argument(metavar="NAME[@VERSION]", help="The line, and a version to pin. Without a version the promoted one is served and followed: a promotion or rollback is served within --reload-seconds.")],
                 store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None,
                 host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface, as in a pod).")] = "127.0.0.1",
                 port: Annotated[int, typer.Option(min=1, max=65535, help="HTTP port.")] = 8080,
                 cache_size: Annotated[int, typer.Option(min=1, help="Models held in memory at once (the global model and the clients' models most recently asked for); a miss reads one file from the store.")] = 32,
                 unknown_client: Annotated[str, typer.Option(help="A client the version has no model for: 'global' answers with the global model (methods that have one), '404' refuses.")] = "global",
                 reload_seconds: Annotated[float, typer.Option(min=0, max=86400, help="Without a pinned version: how often (at most) a request re-reads the promoted pointer; 0 checks on every request.")] = 30.0,
                 max_request_bytes: Annotated[int, typer.Option(min=1024, help="A request body over this is answered 413.")] = 16 * 2**20,
                 max_batch: Annotated[int, typer.Option(min=1, max=65536, help="Rows per request at most.")] = 1024,
                 model_name: Annotated[Optional[str], typer.Option(help="The model's name on the endpoint path, /v2/models/NAME/infer (default: the line's name).")] = None,
                 wait_for_promotion: Annotated[bool, typer.Option("--wait-for-promotion", help="Following the promoted version of a line that has none yet: wait for the first promotion (checked every --reload-seconds, at least 5) instead of stopping; the endpoint listens once there is one (a new install's InferenceService before its first run).")] = False,
                 folder: Annotated[Optional[Path], typer.Option(help="Serve NAME@VERSION from this folder instead of the store: the version's files as KServe's storage initializer downloads them from the InferenceService's storageUri (/mnt/models).")] = None,
                 trust_unsigned: Annotated[bool, typer.Option("--trust-unsigned", help="Serve a model line read without signatures (FEDPIPE_SIGNING_KEY unset): only if you trust everyone who can write its store. A .pt2 holding pickled code, and TorchScript, are refused all the same.")] = False):
    """Serve a model line over HTTP with KServe's model server (the open inference protocol v2, and v1): the global
    model and every client's personalized model behind one endpoint, the client named per request. Models load
    when first asked for into a bounded cache; inputs are raw (pixels 0..255, feature values, token ids) as
    spec.json says. The same program runs in the InferenceService that `fedpipe models deploy` writes. Needs the
    serve extra (pip install 'fedpipe\\[serve]')."""
    from fedpipe.serving.predictor import ServeOptions

    options = ServeOptions(cache_size=cache_size, unknown_client=unknown_client, reload_seconds=reload_seconds,
                           max_batch=max_batch, trust_unsigned=trust_unsigned)
    from fedpipe.serving.predictor import LinePredictor, open_folder

    name = ref.partition("@")[0]
    if folder is not None:
        predictor = open_folder(str(folder), ref, options)
        version = predictor.version
    else:
        if wait_for_promotion and "@" not in ref:
            _wait_for_promotion(_model_line(name, store, config, set), reload_seconds)
        line, _ = _line_and_version(ref, store, config, set, default_latest=False)  # a clear error for a wrong NAME or @VERSION
        version = int(ref.partition("@")[2]) if "@" in ref else None
        predictor = LinePredictor(line, version, options)
    try:
        from fedpipe.serving.kserve_model import serve
    except ImportError as e:
        raise FedpipeError(f"Serving needs the kserve package ({e}): pip install 'fedpipe[serve]'.") from None
    typer.echo(f"serving model line {name} version {predictor.version}{'' if version else ' (promoted, followed)'} "
               f"as /v2/models/{model_name or name}/infer on http://{host}:{port}", err=True)
    serve(predictor, model_name or name, host, port, max_request_bytes)


@models_app.command("deploy", epilog="""Examples:

    fedpipe models deploy sites --store s3://mlpipeline/fedpipe --signing-secret fedpipe-signing --namespace kubeflow-user-example-com > isvc.yaml

    fedpipe models deploy sites --store s3://mlpipeline/fedpipe --signing-secret fedpipe-signing --storage model-registry --namespace team-a --apply

Then: curl -H 'Content-Type: application/json' http://<the InferenceService's URL>/v2/models/sites/infer -d '{"parameters": {"client": "hospital-a"}, "inputs": [...]}' (see `fedpipe models serve --help`).""")
@_guarded
def models_deploy(ref: Annotated[str, typer.Argument(metavar="NAME[@VERSION]", help="The line, and a version to pin. Without a version the predictor follows the promoted one (--storage store), and nothing is read from the store to write the InferenceService; with --storage s3 or model-registry (or --pin) the version promoted now is read from the store, unless given here.")],
                  store: LineStoreOpt = None, config: ConfigOpt = None, set: SetOpt = None,
                  namespace: Annotated[Optional[str], typer.Option(help="Namespace of the InferenceService (a Kubeflow profile's, e.g. kubeflow-user-example-com); needed with --apply.")] = None,
                  image: Annotated[str, typer.Option(help="The predictor's image: fedpipe's image, which has the serve extra; REPOSITORY:TAG or, pinned, REPOSITORY@sha256:DIGEST.")] = f"ghcr.io/fedpipe/fedpipe:{__version__}",
                  image_pull_policy: Annotated[Optional[str], typer.Option(help="The container's imagePullPolicy: Always, IfNotPresent or Never (default: IfNotPresent for an image pinned by digest, Always for a tag, which can be moved to other bytes).")] = None,
                  storage: Annotated[str, typer.Option(help="How the predictor gets the models: 'store' reads the line from the store and follows the promoted version (a promotion is served within --reload-seconds, no rollout); 's3' or 'model-registry' pins the version promoted now (or NAME@VERSION's) as the predictor's STORAGE_URI (s3://.../models/NAME/versions/N/, or model-registry://NAME/N for a version registered in Kubeflow Hub), which KServe downloads; a promotion then needs another deploy.")] = "store",
                  hub_model: Annotated[Optional[str], typer.Option(help="With --storage model-registry: the model's name in Kubeflow Hub (registry.kubeflow_hub.model of the runs; default: the line's name).")] = None,
                  pin: Annotated[bool, typer.Option("--pin", help="With --storage store: serve the version promoted now, never another.")] = False,
                  signing_secret: Annotated[Optional[str], typer.Option(help="Secret holding the signing key the line's runs signed with, under the key 'key' (the chart's: <release>-signing).")] = None,
                  trust_unsigned: Annotated[bool, typer.Option("--trust-unsigned", help="Serve an unsigned line (no --signing-secret): only if everyone who can write the store is trusted.")] = False,
                  s3_endpoint: Annotated[str, typer.Option(help="The S3/MinIO endpoint the predictor reads the store from.")] = "http://minio-service.kubeflow:9000",
                  s3_secret: Annotated[str, typer.Option(help="Secret with the store's credentials (keys accesskey, secretkey), as the pipeline's.")] = "mlpipeline-minio-artifact",
                  service_account: Annotated[Optional[str], typer.Option(help="ServiceAccount of the predictor (with --storage s3: one whose Secret KServe's storage initializer reads S3 credentials from).")] = None,
                  cache_size: Annotated[int, typer.Option(min=1, help="Models the predictor holds in memory at once.")] = 32,
                  unknown_client: Annotated[str, typer.Option(help="'global' or '404' (see `fedpipe models serve --help`).")] = "global",
                  reload_seconds: Annotated[float, typer.Option(min=0, max=86400, help="How often (at most) the predictor re-reads the promoted pointer.")] = 30.0,
                  cpu: Annotated[str, typer.Option(help="CPU request,limit of the predictor.")] = "500m,2",
                  memory: Annotated[str, typer.Option(help="Memory request,limit of the predictor (enough for --cache-size models).")] = "1Gi,4Gi",
                  apply: Annotated[bool, typer.Option("--apply", help="Create or replace it in the cluster (in-cluster config or ~/.kube/config) instead of printing it.")] = False):
    """Write the KServe InferenceService that serves a model line's promoted version (KServe 0.16 of Kubeflow 26.03
    and 0.18 of 26.03.1): a custom predictor running `fedpipe models serve` in fedpipe's image, reading the store
    with the pipeline's credentials and signing key. Prints YAML, or with --apply creates it. The store is read only
    to find the promoted version of a pinned deployment (--storage s3 or model-registry, or --pin) that names none."""
    import yaml

    from fedpipe.serving.inference_service import ServingDeployment, inference_service
    from fedpipe.serving.inference_service import apply as apply_isvc

    name, version = _deployed_version(ref, storage, pin, store, config, set)
    url = store if store is not None else _load(config, set).run.store
    (cpu_req, _, cpu_lim), (mem_req, _, mem_lim) = cpu.partition(","), memory.partition(",")
    deployment = ServingDeployment(line=name, version=version, store=url, image=image, image_pull_policy=image_pull_policy,
                                   namespace=namespace, storage=storage, follow=not pin and version is None,
                                   cache_size=cache_size, unknown_client=unknown_client, reload_seconds=reload_seconds, s3_endpoint=s3_endpoint,
                                   storage_secret=s3_secret, signing_secret=signing_secret, trust_unsigned=trust_unsigned,
                                   service_account=service_account, hub_model=hub_model,
                                   resources={"requests": {"cpu": cpu_req, "memory": mem_req}, "limits": {"cpu": cpu_lim or cpu_req, "memory": mem_lim or mem_req}})
    doc = inference_service(deployment)
    if not apply:
        typer.echo(yaml.safe_dump(doc, sort_keys=False), nl=False)
        return
    if not namespace:
        raise FedpipeError("--apply needs --namespace: the namespace to create the InferenceService in.")
    typer.echo(apply_isvc(doc, namespace))


def _deployed_version(ref: str, storage: str, pin: bool, store, config, overrides) -> tuple[str, Optional[int]]:
    """NAME[@VERSION] of `models deploy`: the line's name, and the version it pins (None: the promoted one, followed).
    The store is read only for a pinned deployment that names no version: the version promoted now."""
    from fedpipe.errors import StoreError

    name, _, given = ref.partition("@")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise FedpipeError(f"{ref!r}: the version after '@' is a number 1, 2, ... (`fedpipe models list {name}`).")
        return name, int(given)
    if storage == "store" and not pin:
        return name, None  # the predictor reads the promoted pointer itself
    try:
        return name, _line_and_version(name, store, config, overrides, default_latest=False)[1]
    except StoreError as e:
        raise FedpipeError(f"{e} To write the InferenceService without reading the store, name the version: "
                           f"fedpipe models deploy {name}@VERSION.") from None


def _wait_for_promotion(line, every: float) -> None:
    import time

    while line.promoted() is None:
        typer.echo(f"model line {line.name} in {line.store.url()} has no promoted version yet: waiting for one", err=True)
        time.sleep(max(5.0, every))
