"""The real image, as `make images` built it and pulled it back from the loopback registry, run with podman.

Each container runs as a locked-down pod would: no network, a read-only root filesystem with only a
tmpfs on /tmp (the chart's emptyDir), all capabilities dropped, no privilege escalation, and the
image's own user. A missing podman or image FAILS (tests/containers.py says to run `make images`).
"""

from __future__ import annotations

import json
import subprocess
import tomllib

import pytest
from containers import built_image, podman, podman_service
from deploytools import REPO, import_tool

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
LOCKED_DOWN = [
    "--network", "none",
    "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,mode=1777,size=512m",
    "--cap-drop", "all", "--security-opt", "no-new-privileges",
]  # fmt: skip
# A tiny real run: fedavg on the mnist5k digits the package ships, 4 clients, 1 round (about 30 s).
TINY = [
    "partition.scheme=pathological", "partition.num_clients=4", "model.name=twonn", "method.name=fedavg",
    "train.rounds=1", "train.local_epochs=1", "train.batch_size=20", "telemetry.progress=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def image() -> str:
    return built_image()


def run(image: str, *command: str, volumes: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess:
    args = [podman(), "run", "--rm", *LOCKED_DOWN, *[f"--volume={v}" for v in volumes], image, *command]
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(command)} failed in the image ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    return result


def test_the_image_comes_from_the_registry_with_the_project_version(image):
    host, _, rest = image.partition("/")
    assert host.startswith("127.0.0.1:") and rest == f"fedpipe/fedpipe:{VERSION}-cuda", image
    labels = json.loads(
        subprocess.run(
            [podman(), "image", "inspect", "--format", "{{json .Labels}}", image], capture_output=True, text=True, check=True
        ).stdout
    )
    assert labels["org.opencontainers.image.version"] == VERSION


def test_the_built_image_asks_for_no_gpu_and_runs_as_the_pipelines_task_user(image):
    """The NVIDIA runtime gives a container whatever NVIDIA_VISIBLE_DEVICES names: `all` baked into the
    image would hand a CPU task every GPU of its node. And the user is the one the pipeline's tasks claim."""
    from fedpipe.pipelines.builder import TASK_USER

    config = json.loads(subprocess.run([podman(), "image", "inspect", "--format", "{{json .Config}}", image],
                                       capture_output=True, text=True, check=True).stdout)
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "void", env
    assert config["User"].split(":")[0] == str(TASK_USER)


def test_non_root_user_workdir_and_a_writable_tmp_only(image):
    out = run(
        image,
        "sh",
        "-c",
        'id -u; id -g; pwd; echo "$MPLCONFIGDIR"; touch /tmp/ok && echo tmp-ok; touch /workspace/x 2>/dev/null || echo root-ro',
    ).stdout.split()
    assert out == ["1000", "1000", "/workspace", "/tmp/matplotlib", "tmp-ok", "root-ro"]


def test_the_pinned_stack_imports_and_the_entry_points_run(image):
    probe = (
        "import json, importlib.metadata as m, torch, torchvision, kfp, fedpipe, kfp.dsl.executor_main, matplotlib.pyplot;"
        "print(json.dumps({p: m.version(p) for p in ('torch', 'torchvision', 'kfp', 'kfp-kubernetes', 'fedpipe')}))"
    )
    versions = json.loads(run(image, "python", "-c", probe).stdout.strip().splitlines()[-1])
    assert versions == {
        "torch": "2.13.0",
        "torchvision": "0.28.0",
        "kfp": "2.17.0",
        "kfp-kubernetes": "2.17.0",
        "fedpipe": VERSION,
    }
    assert "Usage: fedpipe" in run(image, "fedpipe", "--help").stdout
    # What a lightweight KFP component's container runs (its --help needs no executor input).
    assert "--function_to_execute" in run(image, "python3", "-m", "kfp.dsl.executor_main", "--help").stdout


def test_flower_runs_in_its_own_environment_with_the_images_fedpipe(image, tmp_path):
    """Federation mode's processes (SuperLink, SuperNode, flwr) come from /opt/flower (FEDPIPE_FLOWER_ENV): Flower
    1.42.0 with its own pins (typer below 0.21, which fedpipe's own environment has newer), importing the image's
    torch and fedpipe's ServerApp and ClientApp; `fedpipe site keygen` makes a site's key pair in a mounted folder."""
    probe = ("import json, flwr, typer, torch, fedpipe.federation.client_app as c, fedpipe.federation.server_app;"
             "print(json.dumps([flwr.__version__, typer.__version__, torch.__version__, c.__file__]))")
    flwr, typer, torch_version, client_app = json.loads(run(image, "/opt/flower/bin/python", "-c", probe).stdout.strip().splitlines()[-1])
    assert flwr == "1.42.0" and tuple(int(x) for x in typer.split(".")[:2]) < (0, 21), (flwr, typer)
    assert torch_version.startswith("2.13.0") and client_app.startswith("/usr/local/lib/python3.11/site-packages/fedpipe/")
    images_typer = run(image, "python", "-c", "import typer; print(typer.__version__)").stdout.strip()
    assert images_typer != typer  # the pins stay in /opt/flower
    env = run(image, "sh", "-c", 'echo "$FEDPIPE_FLOWER_ENV"; /opt/flower/bin/flower-supernode --help').stdout
    assert env.startswith("/opt/flower\n") and "--root-certificates" in env
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o777)
    keys.chmod(0o777)  # the image's user (1000) writes into it
    run(image, "fedpipe", "site", "keygen", "hospital-a", "--out", "/keys", volumes=(f"{keys}:/keys:rw",))
    assert (keys / "hospital-a.pub").read_text().startswith("ecdsa-sha2-nistp384 ") and (keys / "hospital-a.key").exists()


def test_a_tiny_run_writes_its_report_into_a_mounted_folder(image, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)  # the image's user (1000) writes there, as to a pod's volume
    sets = [a for s in [*TINY, "run.store=/data/store"] for a in ("--set", s)]
    result = run(image, "fedpipe", "run", *sets, "--run-id", "tiny", volumes=(f"{data}:/data",), timeout=240)
    summary = json.loads((data / "store" / "tiny" / "report" / "summary.json").read_text())
    assert "fedavg on mnist5k" in result.stdout, result.stdout
    assert (data / "store" / "tiny" / "report" / "report.md").stat().st_uid == 1000
    assert summary, summary


def test_the_docker_api_of_podman_runs_the_image(image):
    docker = import_tool("docker", "docker (the Docker SDK for Python, in the test extra)")
    with podman_service() as url:
        client = docker.DockerClient(base_url=url)
        try:
            out = client.containers.run(
                image, ["fedpipe", "methods"], network_mode="none", read_only=True, tmpfs={"/tmp": ""}, remove=True
            )
        finally:
            client.close()
    assert b"fedavg" in out
