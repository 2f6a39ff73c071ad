"""The site's pictures, drawn while it builds (never committed), each from what the repository holds:

- images/pipelines/<name>.svg: each compiled pipeline (pipelines/*.yaml) as its DAG, by Graphviz's `dot`;
- images/layers.svg: the library's layers, from the table tests/test_architecture.py enforces;
- images/default-run/report.png: the default run's HTML report (docs/default-run/report.html, what the
  evaluate task writes for the Kubeflow UI) as a browser shows it, by headless Chromium;
- images/default-run/*.png: the default run's label heatmap, accuracy and lam plots, as the run drew them.

Graphviz and Chromium are Debian packages (scripts/test-services.sh installs them).
"""

from __future__ import annotations

import ast
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


def pipeline_dot(spec: dict) -> str:
    """The DAG of a compiled KFP pipeline (IR YAML) in Graphviz's language: a box per task, GPU training tasks
    filled, a ParallelFor as a dashed cluster of its tasks."""
    gpu = {name for name, ex in spec["deploymentSpec"]["executors"].items() if "accelerator" in ex["container"].get("resources", {})}
    lines = ["digraph pipeline {", "rankdir=LR; bgcolor=transparent; nodesep=0.25; ranksep=0.35;",
             'node [shape=box, style="rounded,filled", fillcolor="#eef2f7", color="#5c6b7a", fontname="DejaVu Sans", fontsize=11];',
             'edge [color="#5c6b7a", arrowsize=0.7];']
    edges: set[tuple[str, str]] = set()
    ends: dict[str, tuple[list[str], list[str]]] = {}  # a sub-DAG's node -> (its first tasks, its last tasks)

    def add(dag: dict, prefix: str, depth: int) -> None:
        for name, task in sorted(dag["tasks"].items()):
            node = prefix + name
            component = spec["components"][task["componentRef"]["name"]]
            for dep in task.get("dependentTasks", ()):
                edges.add((prefix + dep, node))
            if "dag" in component:
                label = "ParallelFor: one task per item" if "parameterIterator" in task else task["taskInfo"]["name"]
                lines.append(f'subgraph "cluster_{node}" {{ label={_quote(label)}; style=dashed; color="#8a96a3"; fontname="DejaVu Sans"; fontsize=10;')
                add(component["dag"], node + "/", depth + 1)
                lines.append("}")
                inner = component["dag"]["tasks"]
                needed = {d for t in inner.values() for d in t.get("dependentTasks", ())}
                ends[node] = ([f"{node}/{n}" for n, t in inner.items() if not t.get("dependentTasks")],
                              [f"{node}/{n}" for n in inner if n not in needed])
                continue
            executor = component.get("executorLabel", "")
            style = ', fillcolor="#d7ecd9", color="#3b7d45"' if executor in gpu else ""
            label = task["taskInfo"]["name"] + ("\\n(training, GPU)" if executor in gpu else "")
            lines.append(f'{_quote(node)} [label="{label}"{style}];')

    add(spec["root"]["dag"], "", 0)
    edges = {(x, y) for a, b in edges for x in ends.get(a, ([], [a]))[1] for y in ends.get(b, ([b], []))[0]}
    lines += [f"{_quote(a)} -> {_quote(b)};" for a, b in sorted(_reduced(edges))]
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
