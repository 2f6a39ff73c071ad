"""Every shell and YAML example of the site's Get started and Your data pages, run as a reader would, at tiny
settings: a renamed command, flag or config field fails here instead of in a reader's terminal.

Each command of a ```bash block runs in a scratch folder (with `examples/` and `.venv/` linked in), `fedpipe` as
the venv's, the training commands (run, partition, train, evaluate) with `--set` overrides appended that shrink
them to 2 rounds of 1 local epoch (and, for the bundled data, the digits dataset). A ```yaml block is a config:
`fedpipe config -c` must accept it. Commands that are not run say why, in `NOT_RUN`, and the test checks that
nothing else is left out.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FEDPIPE = ROOT / ".venv" / "bin" / "fedpipe"
TINY = ["train.rounds=2", "train.local_epochs=1"]
TRAINING = {"run", "partition", "train", "evaluate"}
#: commands of these pages that are not run here, and where they are run for real
NOT_RUN = {
    "make test": "the test suite itself (`make -n test` is checked to run pytest)",
    "podman build": "tests/integration/test_own_data_in_containers.py builds that derived image for real",
}


def blocks(page: Path | str) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of a page (or of a part of one's text)."""
    return re.findall(r"^```(\w+)\n(.*?)^```", page if isinstance(page, str) else page.read_text(), flags=re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """The block's commands, continuation lines joined, comments dropped."""
    return [words for line in block.replace("\\\n", " ").splitlines() if (words := shlex.split(line, comments=True))]


def run(words: list[str], cwd: Path, tiny: list[str]) -> subprocess.CompletedProcess:
    args = words[1:]
    if args and args[0] in TRAINING:
        args += [a for s in tiny for a in ("--set", s)]
    done = subprocess.run([str(FEDPIPE), *args], cwd=cwd, capture_output=True, text=True, timeout=900, env=os.environ)
    assert done.returncode == 0, f"`{shlex.join(words)}` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def run_make(target: str, cwd: Path, tiny: list[str]) -> None:
    """`make TARGET` dry (it sets up the venv, which the suite runs in): the target exists, and what it runs is run."""
    done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if target == "test":
        assert "pytest" in done.stdout, done.stdout
        return
    (last,) = [line for line in done.stdout.splitlines() if "fedpipe " in line]
    run(shlex.split(last), cwd, tiny)


def run_page(page: Path, cwd: Path, tiny: list[str]) -> list[str]:
    """Run every example of `page`; returns what ran, for the caller to check."""
    ran = []
    for language, text in blocks(page):
        if language == "yaml":
            (cwd / "example.yaml").write_text(text)
            run(["fedpipe", "config", "-c", "example.yaml"], cwd, tiny)
            ran.append("yaml")
        elif language in ("bash", "sh", "shell"):
            for words in commands(text):
                line = shlex.join(words)
                if any(line.startswith(skip) for skip in NOT_RUN):
                    if line.startswith("make"):
                        run_make(words[1], cwd, tiny)
                    ran.append(f"not run: {line}")
                elif words[0] == "make":
                    run_make(words[1], cwd, tiny)
                    ran.append(line)
                elif Path(words[0]).name == "fedpipe":
                    run(words, cwd, tiny)
                    ran.append(line)
                else:
                    raise AssertionError(f"{page.name}: no way to run `{line}`: add it here or to NOT_RUN")
    return ran


@pytest.fixture
def reader(tmp_path: Path) -> Path:
    """A scratch folder laid out as the repository's root is, for the examples' relative paths."""
    for name in ("examples", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "my.yaml").write_text("method: {name: superfed_mm}\n")
    (tmp_path / "my_config.yaml").write_text("method: {name: fedavg}\n")
    return tmp_path


GET_STARTED = DOCS / "get-started" / "index.md"
#: what each example block of Get started must have run (its first words), so a block dropped or cut shows
GET_STARTED_RUNS = {
    "make run": ["make run", "not run: make test"],
    ".venv/bin/fedpipe run": [".venv/bin/fedpipe run", ".venv/bin/fedpipe run --set method.name=fedavg",
                              ".venv/bin/fedpipe run -c examples/superfed_lm_mnist5k.yaml --set train.rounds=10",
                              ".venv/bin/fedpipe run --benchmark fedavg --benchmark superfed_mm",
                              ".venv/bin/fedpipe config --explain", ".venv/bin/fedpipe methods", ".venv/bin/fedpipe datasets"],
    "fedpipe partition -c my.yaml": ["fedpipe partition -c my.yaml", "fedpipe train -c my.yaml --phase federation",
                                     "fedpipe train -c my.yaml --phase personalization", "fedpipe evaluate -c my.yaml"],
}


def test_get_started_has_the_example_blocks_this_file_expects():
    firsts = [shlex.join(commands(text)[0]) for lang, text in blocks(GET_STARTED) if lang == "bash"]
    assert firsts == list(GET_STARTED_RUNS)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a handful of real pipeline runs through kfp's local runner, a process per task
@pytest.mark.parametrize("first", list(GET_STARTED_RUNS))
def test_get_started_examples_run(reader: Path, first: str):
    (block,) = [text for lang, text in blocks(GET_STARTED) if lang == "bash" and shlex.join(commands(text)[0]) == first]
    page = reader / "page.md"
    page.write_text(f"```bash\n{block}```\n")
    ran = run_page(page, reader, [*TINY, "data.dataset=digits"])
    assert ran == GET_STARTED_RUNS[first]
    if "evaluate" in ran[-1] or "run" in ran[0]:
        assert list((reader / "runs").glob("*/report/summary.json"))  # reports in the default store, runs/


@pytest.mark.slow
def test_your_models_examples_run(reader: Path):
    ran = run_page(DOCS / "data" / "models.md", reader, TINY)
    assert ran == ["not run: podman build -t registry.example.com/ml/fedpipe:0.1.0-cuda .",
                   "fedpipe compile -c my_config.yaml --image-repository registry.example.com/ml/fedpipe"], ran


@pytest.mark.slow
@pytest.mark.services
@pytest.mark.timeout(900)
def test_your_own_data_examples_run_against_s3(reader: Path, raw_client):
    from own_data import upload_folder, write_digit_folders

    upload_folder(raw_client, write_digit_folders(reader / "sites", limit=400), "my-bucket", "sites/2026-11-25")
    ran = run_page(DOCS / "data" / "own-data.md", reader, TINY)
    assert [line.split()[:3] for line in ran] == [["fedpipe", "data", "init"], ["fedpipe", "data", "check"],
                                                  ["fedpipe", "run", "-c"]], ran
    assert (reader / "labels.png").stat().st_size > 0  # data check --heatmap labels.png
    (summary,) = (reader / "runs").glob("*/report/summary.json")
    assert '"dataset": "files"' in summary.read_text()


def test_every_example_page_has_examples_and_the_dataset_pages_none_untested():
    """The pages this file runs hold examples, and the Your data pages hold none this file would skip."""
    for page in ("get-started/index.md", "data/own-data.md", "data/models.md"):
        assert [lang for lang, _ in blocks(DOCS / page) if lang in ("bash", "yaml")], page
    assert not [lang for lang, _ in blocks(DOCS / "data" / "index.md") if lang in ("bash", "sh", "shell", "yaml")]
    assert not [lang for lang, _ in blocks(DOCS / "get-started" / "report.md") if lang in ("bash", "sh", "shell", "yaml")]


# --- the operator's first federation, by hand (docs/federation.md) ------------------------------------------------

FEDERATION = DOCS / "federation.md"
#: what the page's commands become on one test machine: its names and paths stand for a real federation's
ON_THIS_MACHINE = {"fl.example.org": "127.0.0.1", "0.0.0.0": "127.0.0.1"}
#: the operator's section, each command by its first three words, in order
OPERATOR_RUNS = [".venv/bin/fedpipe federation certs", ".venv/bin/fedpipe federation superlink",
                 "PATH=$FEDPIPE_FLOWER_ENV/bin:$PATH FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1 FEDPIPE_CONTROL_TOKEN_FILE=$PWD/certs/control.token",
                 "export FEDPIPE_CONTROL_TOKEN_FILE=$PWD/certs/control.token", "fedpipe site keygen", ".venv/bin/fedpipe federation register", "fedpipe site join", ".venv/bin/fedpipe run -c"]


def _operator_section() -> list[list[str]]:
    text = FEDERATION.read_text()
    start = text.index("## The operator's first federation, by hand")
    section = text[start : text.index("\n## ", start + 1)]
    return [words for lang, block in blocks(section) if lang == "bash" for words in commands(block)]


def _as_here(words: list[str], port: int, site: str = "hospital-a", data: Path | None = None) -> list[str]:
    """A command of the page with its names, port and paths those of this machine (and of `site`)."""
    out = []
    for word in words:
        for name, here in {**ON_THIS_MACHINE, ":9093": f":{port}", "hospital-a": site,
                           f"/data/{site}": str(data), "/var/lib/fedpipe-site": "state"}.items():
            word = word.replace(name, here)
        out.append(str(port) if word == "9093" else word)
    return out


def test_the_operators_section_has_the_commands_this_file_runs():
    """tests/federation/test_operator_docs.py runs these commands, in this order: a command added, dropped or moved shows."""
    assert [" ".join(words[:3]) for words in _operator_section()] == OPERATOR_RUNS
