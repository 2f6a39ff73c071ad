"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, and that build fails on a
broken internal link, a page missing from the navigation, and a generated page that differs from what the code
generates now (scripts/gen_docs.py; the hooks in scripts/mkdocs_hooks.py check it while the site builds).

Each failure is shown by breaking a copy of the site once. The builds run the real MkDocs, Material, Graphviz and
headless Chromium (scripts/test-services.sh installs the last two), a few seconds each."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
sys.path.insert(0, str(ROOT / "scripts"))

import docs_pictures  # noqa: E402
import gen_docs  # noqa: E402

#: Where the tests leave what a person may want to look at (the SuPerFed page's screenshot): build/ is not tracked
OUTPUT = ROOT / "build" / "test-output"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def site_copy(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied into tmp_path (hooks and sources still the repository's): the copy to break."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    config = (ROOT / "mkdocs.yml").read_text()
    config = config.replace("  - scripts/mkdocs_hooks.py", f"  - {ROOT / 'scripts' / 'mkdocs_hooks.py'}")
    (tmp_path / "mkdocs.yml").write_text(config)
    return tmp_path


@pytest.mark.slow
def test_the_site_builds_strict_with_its_pictures(tmp_path: Path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    for page in gen_docs.PAGES:  # every generated page became a page of the site
        assert (site / page).with_suffix(".html").is_file(), page
    for picture in ("images/layers.svg", "images/pipelines/superfed_mm.svg", "images/pipelines/study.svg",
                    "images/default-run/report.png", "images/default-run/accuracy.png",
                    "images/default-run/partition_heatmap.png"):
        assert (site / picture).stat().st_size > 1000, picture
    assert (site / "images/default-run/report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every method page shows its pipeline, drawn from the compiled YAML
    for name in ("superfed_mm", "fedmoe", "ifca"):
        svg = (site / f"images/pipelines/{name}.svg").read_text()
        assert "<svg" in svg and "evaluate" in svg


def rendered_dom(page: Path) -> str:
    """`page` as headless Chromium holds it after its scripts ran (KaTeX renders the math in the browser)."""
    with __import__("tempfile").TemporaryDirectory() as profile:
        done = subprocess.run([docs_pictures.tool("chromium"), *docs_pictures.CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                               "--virtual-time-budget=10000", "--dump-dom", page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_the_method_pages_render_their_equations_offline(tmp_path: Path):
    """Every method page shows its rules as numbered equations, rendered by the KaTeX the site serves itself: every
    displayed equation becomes KaTeX's output in a browser that has no network (no CDN), none is an error, and each
    equation has the code that computes it named beside it. The SuPerFed page is photographed into build/test-output/."""
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    for asset in ("assets/katex/katex.min.js", "assets/katex/katex.min.css", "assets/katex/contrib/auto-render.min.js",
                  "assets/katex/fonts/KaTeX_Main-Regular.woff2", "assets/katex/LICENSE", "assets/javascripts/math.js"):
        assert (site / asset).is_file(), asset
    for family in gen_docs.FAMILIES:
        page = site / "methods" / f"{family}.html"
        html = page.read_text()
        # the renderer comes from the site itself: no script or stylesheet from elsewhere
        assert not re.search(r'<(?:script[^>]*src|link[^>]*href)="(?:https?:)?//', html), family
        assert "assets/katex/katex.min.js" in html, family
        shown = html.count('<div class="arithmatex">')
        tags = len(re.findall(r"\\tag\{", html))
        assert shown >= 3 and tags >= 3, (family, shown, tags)  # update rule, aggregation, personalization at least
        dom = rendered_dom(page)
        assert dom.count('class="katex-display"') == shown, (family, dom.count('class="katex-display"'), shown)
        assert "katex-error" not in dom, re.findall(r'katex-error[^>]*title="([^"]*)"', dom)
        assert dom.count('class="katex-tag"') == tags, family  # each equation's number is shown
        assert "fedpipe: <code>fedpipe/" in html, family  # the code beside the equations
    shot = docs_pictures.screenshot(site / "methods" / "superfed.html", width=1200, height=2200, scripts_ms=10000)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    OUTPUT.mkdir(parents=True, exist_ok=True)
    (OUTPUT / "superfed-equations.png").write_bytes(shot)


def break_link(site: Path) -> str:
    page = site / "docs" / "get-started" / "index.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    return "no-such-page.md"


def break_nav(site: Path) -> str:
    (site / "docs" / "orphan-page.md").write_text("# A page no one can reach\n")
    return "orphan-page.md"


def break_generated_page(site: Path) -> str:
    page = site / "docs" / "reference" / "config.md"
    page.write_text(page.read_text().replace("| `train.rounds` | int | `30` |", "| `train.rounds` | int | `50` |", 1))
    return "reference/config.md is stale"


@pytest.mark.slow
@pytest.mark.parametrize("breaks", [break_link, break_nav, break_generated_page], ids=["broken link", "page not in nav", "stale generated page"])
def test_a_strict_build_fails_on(site_copy: Path, breaks):
    expected = breaks(site_copy)
    done = build(site_copy / "mkdocs.yml", site_copy / "site")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert expected in out, out
    assert "Aborted with" in out and "in strict mode" in out, out


def test_the_generated_pages_are_what_the_code_generates():
    stale = gen_docs.stale_pages()
    assert not stale, f"stale generated pages: {stale}; run {gen_docs.REGENERATE}"


def test_gen_docs_check_names_a_stale_page(tmp_path: Path, monkeypatch):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    monkeypatch.setattr(gen_docs, "DOCS", tmp_path / "docs")
    assert gen_docs.main(["--check"]) == 0
    (tmp_path / "docs" / "methods" / "index.md").write_text("# Methods\n\nCopied by hand.\n")
    assert gen_docs.main(["--check"]) == 1
    assert gen_docs.stale_pages(tmp_path / "docs") == ["methods/index.md"]


def test_the_config_reference_has_every_field_explain_prints():
    from fedpipe.cli.run import _explain
    from fedpipe.run.config import RunConfig

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    fields = [m.group(1) for line in _explain(RunConfig()) if (m := re.match(r"\s+(\S+) = ", line))]
    assert len(fields) > 80
    missing = [f for f in fields if f"`{f}`" not in page]
    assert not missing, missing


def test_the_cli_reference_has_every_command():
    import typer

    from fedpipe.cli import app

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    root = typer.main.get_command(app)
    names = [f"fedpipe {name}" for name in root.commands]
    assert "fedpipe run" in names and "fedpipe models" in names
    assert not [n for n in names if f"`{n}`" not in page]
    assert "## `fedpipe models serve`" in page.replace("### ", "## ")


def test_the_methods_table_has_every_registered_method():
    from fedpipe.algorithms import ALGORITHMS

    page = (ROOT / "docs" / "methods" / "index.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| [`")]
    assert [re.match(r"\| \[`([a-z_]+)`\]", r).group(1) for r in rows] == list(ALGORITHMS)


def test_a_method_without_a_page_stops_the_generator(monkeypatch):
    monkeypatch.setitem(gen_docs.FAMILIES, "baselines", ("Baselines", ("fedavg",)))
    with pytest.raises(SystemExit, match="method 'fedprox' has no page: add it to FAMILIES"):
        gen_docs.generate()


def test_the_readme_is_about_one_screen_and_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make run    # sets up .venv" in readme and "make test   # sets up .venv with the test tools" in readme
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), target


def test_the_pipeline_pictures_label_branches_by_engine_mode_not_by_the_compilers_names():
    import yaml

    for name in ("superfed_mm", "fedmoe", "ifca"):
        spec = next(yaml.safe_load_all((ROOT / "pipelines" / f"{name}.yaml").read_text()))
        dot = docs_pictures.pipeline_dot(spec)
        assert "condition-" in (ROOT / "pipelines" / f"{name}.yaml").read_text()  # the compiler's names are there...
        assert not re.search(r"condition-(?:branches-)?\d", dot), name  # ...and nowhere in the picture, titles included
        assert 'label="engine_mode = simulation"' in dot and 'label="engine_mode = federation"' in dot, name
        # the arrows from config reach the first task of each branch, not a box named after a sub-DAG
        assert '"resolve-config" -> "branches-0/simulation/partition";' in dot, dot
        assert re.search(r'"resolve-config" -> "branches-0/federation/[^"]+";', dot), dot
        boxes = re.findall(r'^"([^"]+)" \[label=', dot, flags=re.M)
        assert not [b for b in boxes if b.endswith(("/simulation", "/federation"))], boxes


def test_a_condition_the_pictures_cannot_name_stops_the_build():
    import yaml

    spec = next(yaml.safe_load_all((ROOT / "pipelines" / "fedavg.yaml").read_text()))
    text = yaml.safe_dump(spec).replace("pipelinechannel--resolve-config-Output", "pipelinechannel--some-task-Output")
    with pytest.raises(RuntimeError, match="name what it means in CONDITION_VALUES"):
        docs_pictures.pipeline_dot(yaml.safe_load(text))


def test_one_way_to_register_a_site_everywhere():
    """The docs and `fedpipe site keygen`'s advice register a site one way, `fedpipe federation register`; Flower's own
    `flwr supernode register NAME.pub <connection>` (a connection the docs never explain) is not offered beside it."""
    raw = re.compile(r"flwr supernode register \S+\.pub")
    pages = [p for p in (ROOT / "docs").rglob("*.md") if "default-run" not in p.parts]
    offered = [f"{p.relative_to(ROOT)}:{n}" for p in pages for n, line in enumerate(p.read_text().splitlines(), 1)
               if raw.search(line)]
    assert not offered, offered
    site_cli = (ROOT / "fedpipe" / "cli" / "site.py").read_text()
    assert not raw.search(site_cli) and "the operator runs `fedpipe federation register" in site_cli
    assert "fedpipe federation register hospital-a.pub --superlink" in (ROOT / "docs" / "federation.md").read_text()
