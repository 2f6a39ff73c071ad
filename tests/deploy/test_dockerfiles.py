"""images/Dockerfile, read by BuildKit's own parser and linted by hadolint.

The image itself is built by `make images` (scripts/build-images.sh, podman/buildah) and run by
test_image.py; these checks hold the structure the build and both of its variants rely on: one
Dockerfile, two builds that differ only in where torch comes from (TORCH_INDEX_URL).
"""

from __future__ import annotations

import re
import shlex
import tomllib

import yaml
from deploytools import CHART, REPO, SETUP_TEST, find_tool, import_tool, run_tool

dockerfile = import_tool("dockerfile", "dockerfile (BuildKit's Dockerfile parser)")
IMAGES = REPO / "images"
DOCKERFILE = IMAGES / "Dockerfile"
SCRIPT = REPO / "scripts" / "build-images.sh"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|cargo|rustc|[a-z0-9.+-]+-dev)\b")
SECRET_NAMES = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|AWS_)", re.IGNORECASE)


def commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def stages() -> dict[str, list[dockerfile.Command]]:
    """The Dockerfile's stages by name (the unnamed last one is "final")."""
    result: dict[str, list[dockerfile.Command]] = {}
    current = None
    for command in commands():
        if command.cmd == "FROM":
            current = command.value[2] if len(command.value) == 3 and command.value[1].upper() == "AS" else "final"
            result[current] = []
        if current:
            result[current].append(command)
    return result


def runs(stage: list[dockerfile.Command]) -> str:
    return "\n".join(" ".join(c.value) for c in stage if c.cmd == "RUN")


def arg_defaults(stage: list[dockerfile.Command] | None = None) -> dict[str, str]:
    return dict(v.split("=", 1) if "=" in v else (v, None) for c in (stage or commands()) if c.cmd == "ARG" for v in c.value)


def test_one_dockerfile_for_both_torch_builds():
    assert sorted(p.name for p in IMAGES.glob("Dockerfile*")) == ["Dockerfile", "Dockerfile.dockerignore"]
    final = stages()["final"]
    # Empty: PyPI's torch (CUDA 13 wheels); the CPU build passes PyTorch's CPU index.
    assert arg_defaults(final)["TORCH_INDEX_URL"] == ""
    (deps,) = [" ".join(c.value) for c in final if c.cmd == "RUN" and "fedpipe-deps" in " ".join(c.value)]
    torch_step, *rest = deps.split("&&")
    assert '${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in torch_step and "-r /tmp/fedpipe-deps/torch.txt" in torch_step
    assert "TORCH_INDEX_URL" not in "".join(rest), "only the torch pair may come from TORCH_INDEX_URL"
    # The script builds the variants with those values and tags: <version>-cuda from PyPI, <version> from the CPU index.
    script = SCRIPT.read_text()
    assert 'cuda) TORCH_INDEX_URL=""' in script and f'cpu) TORCH_INDEX_URL="{CPU_INDEX}"' in script
    assert '[ "$TORCH" = cuda ] && TAG=$VERSION-cuda' in script


def test_pins_come_from_pyproject_only():
    pins = {dep.split("==")[0]: dep.split("==")[1] for dep in PYPROJECT["project"]["dependencies"] if "==" in dep}
    assert (pins["torch"], pins["torchvision"]) == ("2.13.0", "0.28.0")
    text = DOCKERFILE.read_text()
    assert not re.search(r"torch(vision)?==", text.replace("'^torch(vision)?=='", "")), "the Dockerfile must not pin torch itself"
    extract = runs(stages()["requirements"])
    assert "['project']" in extract and "p['dependencies']" in extract and "grep -E '^torch(vision)?=='" in extract
    assert "p['optional-dependencies']['serve']" in extract  # the image is also the InferenceService's predictor
    assert "p['optional-dependencies']['hub']" in extract  # the publish task registers in Kubeflow Hub
    # The dependency layer reads only the extracted list, so other edits of pyproject.toml keep it cached.
    final = stages()["final"]
    copies = [c for c in final if c.cmd == "COPY"]
    assert copies[0].flags == ("--from=requirements",) and copies[0].value[-1] == "/tmp/fedpipe-deps/"


def test_lean_non_root_final_stage():
    final = stages()["final"]
    (user,) = [c.value[0] for c in final if c.cmd == "USER"]
    uid, _, gid = user.partition(":")
    assert (uid, gid) == ("1000", "1000"), f"USER {user}"
    assert [c.value[0] for c in final if c.cmd == "WORKDIR"] == ["/workspace"]
    env = {k: v for c in final if c.cmd == "ENV" for k, v in zip(c.value[::2], c.value[1::2])}
    assert env["MPLCONFIGDIR"] == "/tmp/matplotlib"
    install = runs(final)
    assert not BUILD_TOOLS.search(install), BUILD_TOOLS.search(install)
    # One apt package only, the SuperLink pod's filter (nginx-light), its lists removed, after the dependency layers
    # (the Flower venv's included) and before the source, so that neither the 3 GB layer nor nginx is rebuilt per edit.
    (apt,) = [" ".join(" ".join(c.value).split()) for c in final if c.cmd == "RUN" and "apt-get" in " ".join(c.value)]
    assert "apt-get install -y --no-install-recommends nginx-light &&" in apt and "rm -rf /var/lib/apt/lists/*" in apt
    assert install.index("/opt/flower/bin/pip install") < install.index("nginx-light") < install.index("/tmp/fedpipe-src")
    # Dependencies before the source, and the source installed alone: a code change rebuilds only the last layers.
    assert install.index("requirements.txt") < install.index("/tmp/fedpipe-src")
    assert "--no-deps /tmp/fedpipe-src" in install and "pip check" in install
    sources = [(c.flags, c.value) for c in final if c.cmd in ("COPY", "ADD")]
    assert sources[-1] == ((), (".", "/tmp/fedpipe-src")), sources
    # Prebuilt wheels come in through a bind mount of the optional `wheels` context, never a layer.
    assert stages()["wheels"][0].value[0] == "scratch"
    installs = [c for c in final if c.cmd == "RUN" and "pip install" in " ".join(c.value)]
    assert len(installs) == 3  # the dependencies, Flower's own venv (/opt/flower), fedpipe
    assert all("--mount=type=bind,from=wheels,target=/wheels" in c.flags for c in installs)
    assert "${WHEELS_ONLY:+--no-index}" in install


def env_of(stage: list[dockerfile.Command]) -> dict[str, str]:
    return {k: v for c in stage if c.cmd == "ENV" for k, v in zip(c.value[::2], c.value[1::2])}


def test_the_image_asks_for_no_gpu_of_its_own():
    # A GPU reaches a pod only through what the node sets up for it: the device plugin (NVIDIA_VISIBLE_DEVICES=<its
    # GPUs>, or the volume-mounts list, or CDI) or `docker run --gpus`. `all` baked into the image made the NVIDIA
    # runtime (which by default honours the variable in unprivileged containers) hand every GPU of the node to any
    # pod of this image, CPU tasks included. `void` is the runtime's "behave like runc"; it also overrides an `all`
    # inherited from another BASE_IMAGE (nvidia/cuda sets it).
    for name, stage in stages().items():
        assert env_of(stage).get("NVIDIA_VISIBLE_DEVICES", "void") == "void", f"stage {name} asks for GPUs"
    final = env_of(stages()["final"])
    assert final.get("NVIDIA_VISIBLE_DEVICES") == "void"
    # A "legacy CUDA image" (CUDA_VERSION without NVIDIA_REQUIRE_CUDA) makes the toolkit treat an unset or empty
    # NVIDIA_VISIBLE_DEVICES as `all` (nvidia-container-toolkit internal/config/image/cuda_image.go).
    assert "CUDA_VERSION" not in final or "NVIDIA_REQUIRE_CUDA" in final


def test_python_311_base_and_no_secrets_baked_in():
    assert arg_defaults()["BASE_IMAGE"] == "python:3.11-slim-bookworm"
    assert [c.value[0] for c in commands() if c.cmd == "FROM"] == ["scratch", "${BASE_IMAGE}", "${BASE_IMAGE}"]
    for command in commands():
        if command.cmd in ("ENV", "ARG"):
            names = command.value[::2] if command.cmd == "ENV" else [v.split("=")[0] for v in command.value]
            assert not [n for n in names if SECRET_NAMES.search(n)], f"{command.original} sets a credential"


def test_versions_agree_with_pyproject_and_the_chart():
    assert arg_defaults()["VERSION"] == VERSION
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION


def test_build_gets_every_folder_pip_install_needs():
    # pyproject.toml maps top-level folders into the package: each must be in the context (COPY . takes it).
    folders = {"fedpipe"} | {path.split("/")[0] for path in PYPROJECT["tool"]["setuptools"].get("package-dir", {}).values()}
    ignore = (IMAGES / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"], "the context should start from nothing"
    for needed in sorted(folders) + ["pyproject.toml", "README.md"]:
        assert f"!{needed}/" in ignore or f"!{needed}" in ignore, f"{needed} is ignored by Dockerfile.dockerignore"
    for kept_out in (".venv", ".cache", "runs", ".git"):
        assert f"!{kept_out}" not in ignore and f"!{kept_out}/" not in ignore


def test_the_build_script_passes_what_the_dockerfile_declares():
    script = SCRIPT.read_text()
    build = script[script.index("$PODMAN build") :].split("\n")[0:3]
    words = shlex.split(" ".join(line.rstrip("\\") for line in build).replace('"', ""))
    assert "--ignorefile" in words and words[words.index("--ignorefile") + 1] == "images/Dockerfile.dockerignore"
    assert words[words.index("-f") + 1] == "images/Dockerfile"
    passed = set(re.findall(r"--build-arg \"?([A-Z_]+)=", script))
    assert passed == {"BASE_IMAGE", "VERSION", "TORCH_INDEX_URL", "WHEELS_ONLY"} and passed <= set(arg_defaults())
    assert '--build-context "wheels=' in script


def test_hadolint_passes():
    hadolint = find_tool("hadolint", SETUP_TEST)
    run_tool([hadolint, "--failure-threshold", "info", str(DOCKERFILE)])
