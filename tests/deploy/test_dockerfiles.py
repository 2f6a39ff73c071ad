"""The Dockerfiles, read by BuildKit's own parser and linted by hadolint.

No image is built here (no Docker engine on these machines; images/README.md says so): these
checks hold the structure the build relies on.
"""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml
from deploytools import CHART, REPO, SETUP_TEST, find_tool, import_tool, run_tool

dockerfile = import_tool("dockerfile", "dockerfile (BuildKit's Dockerfile parser)")
IMAGES = REPO / "images"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|cargo|rustc|[a-z0-9.+-]+-dev)\b")
SECRET_NAMES = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|AWS_)", re.IGNORECASE)


def stages(path) -> list[list[dockerfile.Command]]:
    """The Dockerfile's instructions, split into stages (each starts with FROM)."""
    result: list[list[dockerfile.Command]] = []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            result.append([])
        if result:
            result[-1].append(command)
    return result


def runs(stage: list[dockerfile.Command]) -> str:
    return "\n".join(" ".join(c.value) for c in stage if c.cmd == "RUN")


@pytest.fixture(params=["Dockerfile", "Dockerfile.cuda"])
def image(request):
    return IMAGES / request.param


def test_multi_stage_with_a_lean_non_root_final_stage(image):
    builder, final = stages(image)
    assert builder[0].value[-2:] == ("AS", "builder")
    assert "pip wheel" in runs(builder)
    (user,) = [c.value[0] for c in final if c.cmd == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0), f"USER {user} is not a numeric non-root user"
    assert any(c.cmd == "WORKDIR" for c in final)
    # The runtime stage installs the builder's wheels, offline, and no compilers or headers.
    install = runs(final)
    assert "--mount=type=bind,from=builder" in " ".join(f for c in final for f in c.flags)
    assert "--no-index" in install and '"fedpipe==${VERSION}"' in install
    assert not BUILD_TOOLS.search(install), BUILD_TOOLS.search(install)
    assert "apt-get install" not in install
    assert not [c for c in final if c.cmd in ("COPY", "ADD")], "the runtime stage copies files from the context"


def test_python_311_base_and_no_secrets_baked_in(image):
    commands = dockerfile.parse_file(str(image))
    (base,) = {c.value[0].split("=", 1)[1] for c in commands if c.cmd == "ARG" and c.value[0].startswith("PYTHON_IMAGE=")}
    assert base.startswith("python:3.11-")
    for command in commands:
        if command.cmd in ("ENV", "ARG"):
            names = command.value[::2] if command.cmd == "ENV" else [v.split("=")[0] for v in command.value]
            assert not [n for n in names if SECRET_NAMES.search(n)], f"{command.original} sets a credential"


def test_torch_pair_is_pinned_as_pyproject_pins_it(image):
    pins = {dep.split("==")[0]: dep.split("==")[1] for dep in PYPROJECT["project"]["dependencies"] if "==" in dep}
    builder = runs(stages(image)[0])
    cuda = image.name.endswith(".cuda")
    for package in ("torch", "torchvision"):
        found = re.findall(rf'"{package}==([0-9.]+)(\+cpu)?"', builder)
        assert found == [(pins[package], "" if cuda else "+cpu")], f"{image.name}: {package} pins {found}"
    assert (pins["torch"], pins["torchvision"]) == ("2.13.0", "0.28.0")
    # CPU builds come from PyTorch's CPU index; the CUDA image takes PyPI's default (CUDA 13) build.
    assert ("download.pytorch.org/whl/cpu" in builder) != cuda


def test_versions_agree_with_pyproject_and_the_chart(image):
    (version,) = [c.value[0] for c in dockerfile.parse_file(str(image)) if c.cmd == "ARG" and c.value[0].startswith("VERSION=")]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert version == f"VERSION={VERSION}" and chart["appVersion"] == VERSION


def test_build_gets_every_folder_pip_install_needs(image):
    # pyproject.toml maps top-level folders into the package: each must be copied and not ignored.
    folders = {"fedpipe"} | {path.split("/")[0] for path in PYPROJECT["tool"]["setuptools"].get("package-dir", {}).values()}
    copied = {c.value[0] for c in stages(image)[0] if c.cmd == "COPY"}
    assert folders <= copied, f"not copied: {folders - copied}"
    ignore = (IMAGES / f"{image.name}.dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"], "the context should start from nothing"
    for needed in sorted(folders) + ["pyproject.toml", "README.md"]:
        assert f"!{needed}/" in ignore or f"!{needed}" in ignore, f"{needed} is ignored by {image.name}.dockerignore"


def test_both_dockerignores_keep_the_same_files():
    def rules(name: str) -> list[str]:
        return [line for line in (IMAGES / name).read_text().splitlines() if line and not line.startswith("#")]

    assert rules("Dockerfile.dockerignore") == rules("Dockerfile.cuda.dockerignore")


def test_hadolint_passes():
    hadolint = find_tool("hadolint", SETUP_TEST)
    run_tool([hadolint, "--failure-threshold", "info", str(IMAGES / "Dockerfile"), str(IMAGES / "Dockerfile.cuda")])
