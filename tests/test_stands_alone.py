"""The repository stands alone: no tracked file sends its reader to a file outside it (a sibling folder of shared
notes, a reference note that only the machine it was written on had) or to an absolute path of one machine (a build
machine's work folder, someone's home folder). What the project took from such notes is written into its own pages (docs/methods/*.md,
docs/faithfulness.md) with the paper and the authors' code cited; a reproduction cites its paper by title, venue and
section.

Quoted third-party text is exempt: the files vendored as they were published (KaTeX under docs/assets/katex/)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What points outside the repository, by what it is (each pattern is written so that it does not match itself)
OUTSIDE = {
    "a sibling folder of shared notes": re.compile(r"\.\./shared\b"),
    "a reference note kept outside the repository": re.compile(
        r"(?<![\w/.-])(?:shared/)?reference/(?:superfed|fedmn|fedmoe|peers|kubeflow|environment)\.md"),
    "a paper's text file kept outside the repository": re.compile(r"papers/\d{3}_[0-9a-f]{16}\.txt"),
    "an absolute path of a build machine": re.compile(r"(?<![\w.~-])/(?:work|Users)/[\w.-]"),
    "someone's home folder": re.compile(r"(?<![\w.~-])/home/(?!fedpipe\b)[\w.-]+/"),
}
#: Published third-party files, kept byte for byte as their authors wrote them
THIRD_PARTY = ("docs/assets/katex/",)
SKIP_DIRS = {".git", ".venv", "build", ".cache", "runs", "__pycache__", ".pytest_cache", ".hypothesis", "node_modules"}


def tracked_files() -> list[str]:
    """The repository's files: git's list, or (a copy without .git) every file outside the build folders."""
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True)
        return [f for f in done.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        out = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            out += [str((Path(folder) / f).relative_to(ROOT)) for f in files]
        return out


def pointers_outside(files: list[str], root: Path = ROOT) -> list[str]:
    """`path:line: what` for every line of `files` (under `root`) that points outside the repository."""
    found = []
    for name in files:
        if name.startswith(THIRD_PARTY):
            continue
        path = root / name
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # a binary file (a picture, a model): no text to point anywhere
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            for what, pattern in OUTSIDE.items():
                if pattern.search(line):
                    found.append(f"{name}:{number}: {what}: {line.strip()[:160]}")
    return found


def test_no_tracked_file_points_outside_the_repository():
    found = pointers_outside(tracked_files())
    assert not found, ("these lines send the reader outside the repository; write what they point at into the "
                       "project's own pages (docs/methods/, docs/faithfulness.md) and cite the paper or the authors' "
                       "code instead:\n" + "\n".join(found))


def test_each_kind_of_pointer_outside_is_found(tmp_path: Path):
    # each bad line is put together here, so that this file itself points nowhere (the check reads it too)
    up, note, machine = "../" + "shared", "reference/" + "fedmn.md", "/" + "work/"
    lines = {
        "a.md": f"SuPerFed's formulas: see {up}/reference/superfed.md\n",
        "b.py": f'"""As restated in {note}."""\n',
        "c.yaml": "# The paper: papers/" + "004_0376f4a9fe0931e0.txt (Sec. 5)\n",
        "d.sh": f"python mixture_records.py {machine}repro-runs/runs/*.json\n",
        "e.txt": "open /" + "home/alice/notes.md\n",
        "docs/assets/katex/x.js": f"// {up} is the vendor's business\n",
        "fine.md": "The image's user lives in /home/fedpipe/; results go to /tmp/fl; see docs/reference/config.md\n",
    }
    for name, text in lines.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = pointers_outside(list(lines), tmp_path)
    assert [f.split(":")[0] for f in found] == ["a.md", "b.py", "c.yaml", "d.sh", "e.txt"], found
