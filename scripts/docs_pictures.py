"""The site's pictures, drawn while it builds (never committed), each from what the repository holds:

- images/pipelines/<name>.svg: each compiled pipeline (pipelines/*.yaml) as its DAG, by Graphviz's `dot`, each
  condition's branch labelled by what it means (`engine_mode = federation`), not by the compiler's names;
- images/layers.svg: the library's layers, from the table tests/test_architecture.py enforces;
- images/default-run/report.png: the default run's HTML report (docs/default-run/report.html, what the
  evaluate task writes for the Kubeflow UI) as a browser shows it, by headless Chromium;
- images/default-run/*.png: the default run's label heatmap, accuracy and lam plots, as the run drew them.

Graphviz and Chromium are Debian packages (scripts/test-services.sh installs them).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUN = ROOT / "docs" / "default-run"
INSTALL = "scripts/test-services.sh --docs installs it (apt: graphviz, chromium)"
#: Debian's Chromium in a container as root with no network (see .library's notes): no sandbox, no GPU,
#: nothing that phones home, a fresh profile
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--force-device-scale-factor=1")


def tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if not path:
        raise RuntimeError(f"the docs' pictures need {name}, which is not installed: {INSTALL}")
    return path


def dot_svg(source: str) -> bytes:
    done = subprocess.run([tool("dot"), "-Tsvg"], input=source.encode(), capture_output=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"dot failed: {done.stderr.decode(errors='replace')[:500]}")
    return done.stdout


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _reduced(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Without the edges another path already implies (every task depends on `config`: one arrow says it)."""
    after: dict[str, set[str]] = {}
    for a, b in edges:
        after.setdefault(a, set()).add(b)

    def reachable_without(a: str, b: str) -> bool:
        """Whether b can be reached from a other than by the edge a -> b itself."""
        seen, todo = set(), [n for n in after.get(a, ()) if n != b]
        while todo:
            node = todo.pop()
            if node == b:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(after.get(node, ()))
        return False

    return {(a, b) for a, b in edges if not reachable_without(a, b)}


#: What a condition's value means, by the task output it tests (`<producer task>-<output>` as the compiled IR's pipeline
#: channel names it): resolve-config's Output is the run's engine mode (pipelines/builder.py, dsl.If / dsl.Else).
CONDITION_VALUES = {"resolve-config-Output": "engine_mode"}
#: The names the KFP compiler gives a condition's sub-DAGs (condition-2, condition-branches-1): never shown
COMPILER_NAME = re.compile(r"^condition-(?:branches-)?\d+$")


def _condition_subject(component: dict, task: dict) -> str:
    """What a condition (or a group of If / Elif / Else branches) tests, in the pipeline's words: engine_mode."""
    texts = [t.get("triggerPolicy", {}).get("condition", "") for t in component["dag"]["tasks"].values()]
    texts.append(task.get("triggerPolicy", {}).get("condition", ""))
    channels = {m for text in texts for m in re.findall(r"pipelinechannel--([\w-]+)", text)}
    if len(channels) != 1 or next(iter(channels)) not in CONDITION_VALUES:
        raise RuntimeError(f"a condition of the pipeline tests {sorted(channels) or 'nothing known'}: name what it means in "
                           "CONDITION_VALUES (scripts/docs_pictures.py), so that its picture shows that, not the compiler's names")
    return CONDITION_VALUES[next(iter(channels))]


def _cluster_label(component: dict, task: dict) -> str:
    """A sub-DAG's label by what it means: `engine_mode = simulation` for a condition's branch (the branch's name,
    as the pipeline names it), `engine_mode: one branch runs` for a group of branches, or the ParallelFor."""
    if "parameterIterator" in task:
        return "ParallelFor: one task per item"
    name = task["taskInfo"]["name"]
    if "triggerPolicy" in task:  # a branch: dsl.If / Elif / Else, named by the builder
        if COMPILER_NAME.match(name):
            raise RuntimeError(f"a condition's branch has only the compiler's name {name!r}: give it one (dsl.If(..., name=...))")
        return f"{_condition_subject(component, task)} = {name}"
    if COMPILER_NAME.match(name):  # the group of an If's branches
        return f"{_condition_subject(component, task)}: one branch runs"
    return name


def pipeline_dot(spec: dict) -> str:
    """The DAG of a compiled KFP pipeline (IR YAML) in Graphviz's language: a box per task, GPU training tasks
    filled, a ParallelFor as a dashed cluster of its tasks, a condition's branch as a dashed cluster labelled by what
    it means (`engine_mode = federation`). The compiler's names of conditions (condition-branches-1) appear nowhere,
    not even in the SVG's hidden titles."""
    gpu = {name for name, ex in spec["deploymentSpec"]["executors"].items() if "accelerator" in ex["container"].get("resources", {})}
    lines = ["digraph pipeline {", "rankdir=LR; bgcolor=transparent; nodesep=0.25; ranksep=0.35;",
             'node [shape=box, style="rounded,filled", fillcolor="#eef2f7", color="#5c6b7a", fontname="DejaVu Sans", fontsize=11];',
             'edge [color="#5c6b7a", arrowsize=0.7];']
    edges: set[tuple[str, str]] = set()
    ends: dict[str, tuple[list[str], list[str]]] = {}  # a sub-DAG's node -> (its first tasks, its last tasks)
    shown: dict[str, str] = {}  # a node's path in the IR -> its name in the picture (branch names for condition names)

    def add(dag: dict, prefix: str, shown_prefix: str, depth: int) -> None:
        for name, task in sorted(dag["tasks"].items()):
            node = prefix + name
            component = spec["components"][task["componentRef"]["name"]]
            for dep in task.get("dependentTasks", ()):
                edges.add((prefix + dep, node))
            if "dag" in component:
                label = _cluster_label(component, task)
                inner = task["taskInfo"]["name"] if not COMPILER_NAME.match(task["taskInfo"]["name"]) else f"branches-{depth}"
                shown[node] = shown_prefix + inner
                lines.append(f'subgraph {_quote("cluster_" + shown[node])} {{ label={_quote(label)}; style=dashed; color="#8a96a3"; fontname="DejaVu Sans"; fontsize=10;')
                add(component["dag"], node + "/", shown[node] + "/", depth + 1)
                lines.append("}")
                inner_tasks = component["dag"]["tasks"]
                needed = {d for t in inner_tasks.values() for d in t.get("dependentTasks", ())}
                ends[node] = ([f"{node}/{n}" for n, t in inner_tasks.items() if not t.get("dependentTasks")],
                              [f"{node}/{n}" for n in inner_tasks if n not in needed])
                continue
            executor = component.get("executorLabel", "")
            style = ', fillcolor="#d7ecd9", color="#3b7d45"' if executor in gpu else ""
            label = task["taskInfo"]["name"] + ("\\n(training, GPU)" if executor in gpu else "")
            shown[node] = shown_prefix + name
            lines.append(f'{_quote(shown[node])} [label="{label}"{style}];')

    def firsts(node: str) -> list[str]:  # the tasks an arrow into `node` reaches, through nested sub-DAGs
        return [t for inner in ends[node][0] for t in firsts(inner)] if node in ends else [node]

    def lasts(node: str) -> list[str]:  # the tasks an arrow out of `node` leaves from
        return [t for inner in ends[node][1] for t in lasts(inner)] if node in ends else [node]

    add(spec["root"]["dag"], "", "", 0)
    edges = {(x, y) for a, b in edges for x in lasts(a) for y in firsts(b)}
    lines += [f"{_quote(shown[a])} -> {_quote(shown[b])};" for a, b in sorted(_reduced(edges))]
    return "\n".join(lines + ["}"]) + "\n"


def pipeline_pictures() -> dict[str, bytes]:
    out = {}
    for path in sorted((ROOT / "pipelines").glob("*.yaml")):
        spec = next(yaml.safe_load_all(path.read_text()))
        out[f"images/pipelines/{path.stem}.svg"] = dot_svg(pipeline_dot(spec))
    return out


def _module_path(module: str) -> str:
    """fedpipe.engine -> fedpipe/engine/, fedpipe.errors -> fedpipe/errors.py, fedpipe.components -> components/."""
    if module == "fedpipe":
        return "fedpipe/__init__.py"
    name = module.removeprefix("fedpipe.")
    if (ROOT / name).is_dir():  # components/ and pipelines/ are installed inside the package
        return f"{name}/"
    return f"{name}/" if (ROOT / "fedpipe" / name).is_dir() else f"{name}.py"


def layers_dot() -> str:
    """The layers of tests/test_architecture.py's LAYERS, lowest at the bottom, each with its modules."""
    tree = ast.parse((ROOT / "tests" / "test_architecture.py").read_text())
    layers = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.AnnAssign | ast.Assign)
                  and "LAYERS" in {getattr(t, "id", None) for t in getattr(node, "targets", [getattr(node, "target", None)])})
    lines = ["digraph layers {", "rankdir=BT; bgcolor=transparent; nodesep=0.3; ranksep=0.3;",
             'node [shape=box, style="rounded,filled", fillcolor="#eef2f7", color="#5c6b7a", fontname="DejaVu Sans", fontsize=11, width=5.5];',
             'edge [color="#5c6b7a", arrowsize=0.7, label=" imports", fontname="DejaVu Sans", fontsize=9, dir=back];']
    names = []
    for layer, modules in layers:
        shown = ", ".join(_module_path(m) for m in modules)
        names.append(layer)
        lines.append(f'{_quote(layer)} [label=<<b>{layer}</b><br/><font point-size="9">{shown}</font>>];')
    lines += [f"{_quote(low)} -> {_quote(high)};" for low, high in zip(names, names[1:])]
    return "\n".join(lines + ["}"]) + "\n"


def screenshot(html: Path, width: int = 1100, height: int = 960, scripts_ms: int = 0) -> bytes:
    """`html` as headless Chromium shows it, a PNG of width x height pixels; `scripts_ms`: first give the page's
    scripts that much (virtual) time, for a page that renders in the browser (the site's math)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "shot.png"
        wait = [f"--virtual-time-budget={scripts_ms}"] if scripts_ms else []
        cmd = [tool("chromium"), *CHROMIUM_FLAGS, *wait, f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}",
               f"--screenshot={out}", html.resolve().as_uri()]
        done = subprocess.run(cmd, capture_output=True, timeout=120)
        if not out.exists():
            raise RuntimeError(f"chromium made no screenshot of {html} (exit {done.returncode}): "
                               f"{done.stderr.decode(errors='replace')[-800:]}")
        return out.read_bytes()


def default_run_pictures() -> dict[str, bytes]:
    out = {f"images/default-run/{p.name}": p.read_bytes() for p in sorted(DEFAULT_RUN.glob("*.png"))}
    out["images/default-run/report.png"] = screenshot(DEFAULT_RUN / "report.html")  # the first screen: summary, accuracy
    return out


def all_pictures() -> dict[str, bytes]:
    """{path in the site: bytes} of every picture the pages show."""
    return {**pipeline_pictures(), "images/layers.svg": dot_svg(layers_dot()), **default_run_pictures()}
