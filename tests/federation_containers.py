"""A rendered chart's pods run as podman containers on this machine, as far as the kubelet's part can be done here.

For one container of a rendered pod, `PodContainer.podman_args` gives the `podman run` command line that does what a
kubelet would do for it, from the manifests alone:

- command and args as rendered (the image has no ENTRYPOINT, so they are the container's command line), with
  Kubernetes' ``$(VAR)`` references expanded from the container's env;
- env as rendered: plain values, and ``valueFrom.secretKeyRef`` resolved from the Secrets the caller hands in (the
  chart's own rendered Secrets, and those the test makes as an operator would: `fedpipe federation certs
  --kubernetes-secret` writes the TLS and CA Secrets' manifests, a site key Secret is what `kubectl create secret
  generic --from-file` would make);
- volumes: a Secret or ConfigMap is written out as files in a folder of its own (its ``items`` and modes, owned by
  root and the pod's fsGroup, as the kubelet does) and bind-mounted read-only at the rendered mountPath; an emptyDir
  is a tmpfs; a PersistentVolumeClaim is a folder here (writable by the pod's user); a hostPath is bind-mounted as is;
- the securityContext podman can express: runAsUser/runAsGroup -> ``--user``, fsGroup -> ``--group-add``,
  readOnlyRootFilesystem -> ``--read-only`` (without podman's extra tmpfs mounts, so only the rendered emptyDirs are
  writable), capabilities.drop ALL -> ``--cap-drop ALL``, allowPrivilegeEscalation false -> ``no-new-privileges``;
  seccomp RuntimeDefault is podman's default profile;
- the network: ``--network host``, so every container is on this machine's loopback (environment.md: podman's bridge
  is not for traffic here). In a cluster each pod has a loopback of its own.

Not done here: resource requests and limits (cgroup limits do not work on these machines), probes (the caller waits
for the ports itself), Services and NetworkPolicies (no cluster network: everything dials 127.0.0.1).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "deploy"))
from deploytools import CLUSTER, GET_HELM, find_tool, parse_docs, run_tool  # noqa: E402


def helm() -> str:
    return find_tool("helm", GET_HELM)


def render(chart: Path, release: str, namespace: str, *args: str, cluster: bool = True) -> list[dict]:
    """`helm template` of `chart` as parsed documents (the main chart needs CLUSTER, its API server's address)."""
    extra = CLUSTER if cluster else []
    return parse_docs(run_tool([helm(), "template", release, str(chart), "--namespace", namespace, *extra, *args]).stdout)


def secrets_of(docs: list[dict]) -> dict[str, dict[str, bytes]]:
    """{Secret name: {key: bytes}} of the Secret manifests among `docs` (data is base64, stringData plain)."""
    out = {}
    for doc in docs:
        if doc.get("kind") == "Secret":
            data = {k: base64.b64decode(v) for k, v in (doc.get("data") or {}).items()}
            data.update({k: str(v).encode() for k, v in (doc.get("stringData") or {}).items()})
            out[doc["metadata"]["name"]] = data
    return out


def secret_manifest_file(path: Path) -> dict[str, dict[str, bytes]]:
    return secrets_of(parse_docs(path.read_text()))


def config_maps_of(docs: list[dict]) -> dict[str, dict[str, bytes]]:
    return {d["metadata"]["name"]: {k: str(v).encode() for k, v in (d.get("data") or {}).items()}
            for d in docs if d.get("kind") == "ConfigMap"}


def pod_spec(docs: list[dict], kind: str, name_suffix: str) -> dict:
    """The pod spec of the one workload of `kind` whose name ends with `name_suffix`."""
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    return found["spec"]["template"]["spec"]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values; $$(VAR) stays literal, unknown names stay."""
    return re.sub(r"\$\$\(|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$(" if m[1] is None else env.get(m[1], m[0]), text)


def _write_files(folder: Path, files: dict[str, bytes], mode: int, gid: int | None) -> None:
    folder.mkdir(parents=True)
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chown(path, 0, gid if gid is not None else 0)
        path.chmod(mode)
    for d in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        os.chown(d, 0, gid if gid is not None else 0)
        d.chmod(0o755)


@dataclass
class PodContainer:
    """One container of a rendered pod, to be run with podman as the kubelet would run it (module docstring)."""

    pod: dict
    name: str
    secrets: dict[str, dict[str, bytes]]
    config_maps: dict[str, dict[str, bytes]] = field(default_factory=dict)
    claims: dict[str, Path] = field(default_factory=dict)  # PVC name -> folder here (made when absent)

    @property
    def spec(self) -> dict:
        (found,) = [c for c in self.pod["containers"] if c["name"] == self.name]
        return found

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for entry in self.spec.get("env", []):
            if "value" in entry:
                out[entry["name"]] = _expand(str(entry["value"]), out)
            else:
                ref = entry["valueFrom"]["secretKeyRef"]
                out[entry["name"]] = self.secrets[ref["name"]][ref["key"]].decode()
        return out

    def command(self) -> list[str]:
        env = self.env()
        return [_expand(a, env) for a in [*self.spec.get("command", []), *self.spec.get("args", [])]]

    def security(self) -> dict:
        return {**self.pod.get("securityContext", {}), **self.spec.get("securityContext", {})}

    def _volume(self, name: str) -> dict:
        (found,) = [v for v in self.pod.get("volumes", []) if v["name"] == name]
        return found

    def mounts(self, work: Path) -> list[str]:
        """podman's mount options for the container's volumeMounts; Secrets and ConfigMaps written under `work`."""
        fs_group = self.pod.get("securityContext", {}).get("fsGroup")
        args: list[str] = []
        for mount in self.spec.get("volumeMounts", []):
            volume, target = self._volume(mount["name"]), mount["mountPath"]
            ro = ",ro" if mount.get("readOnly") else ""
            if "emptyDir" in volume:
                args += ["--tmpfs", f"{target}:rw,mode=1777"]
                continue
            if "secret" in volume or "configMap" in volume:
                source = volume.get("secret") or volume["configMap"]
                ref = source.get("secretName") or source.get("name")
                data = (self.secrets if "secret" in volume else self.config_maps)[ref]
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                folder = work / f"{self.name}-{mount['name']}"
                if not folder.exists():
                    _write_files(folder, {i["path"]: data[i["key"]] for i in items}, source.get("defaultMode", 0o644), fs_group)
                args += ["-v", f"{folder}:{target}:ro"]  # the kubelet mounts Secrets and ConfigMaps read-only
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                folder = self.claims.setdefault(claim, work / f"claim-{claim}")
                if not folder.exists():
                    folder.mkdir(parents=True)
                    os.chown(folder, self.security().get("runAsUser", 0), fs_group or 0)
                    folder.chmod(0o770)
                args += ["-v", f"{folder}:{target}:{'ro' if ro or volume['persistentVolumeClaim'].get('readOnly') else 'rw'}"]
            elif "hostPath" in volume:
                args += ["-v", f"{volume['hostPath']['path']}:{target}:{'ro' if ro else 'rw'}"]
            else:
                raise AssertionError(f"volume {mount['name']} of container {self.name}: a kind this helper cannot run: {volume}")
        return args

    def podman_args(self, image: str, container_name: str, work: Path, extra_args: list[str] = (),
                    extra_env: dict[str, str] | None = None) -> list[str]:
        """`podman run -d ...` for this container; `extra_args` appended to its command line and `extra_env` added to
        its env (each a deviation from the rendered pod: say why where used)."""
        sc = self.security()
        args = ["run", "-d", "--name", container_name, "--network", "host", "--pull", "never"]
        if "runAsUser" in sc:
            args += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
        if self.pod.get("securityContext", {}).get("fsGroup") is not None:
            args += ["--group-add", str(self.pod["securityContext"]["fsGroup"])]
        if sc.get("readOnlyRootFilesystem"):
            args += ["--read-only", "--read-only-tmpfs=false"]
        if "ALL" in sc.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", "ALL"]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if sc.get("privileged"):
            raise AssertionError(f"container {self.name} asks to be privileged")
        for key, value in {**self.env(), **(extra_env or {})}.items():
            args += ["--env", f"{key}={value}"]
        args += self.mounts(work)
        return [*args, image, *self.command(), *extra_args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, what: str, alive, timeout: float = 60) -> None:
    """Until 127.0.0.1:port accepts; `alive()` returns a log tail when what should listen there has stopped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        stopped = alive()
        if stopped:
            raise AssertionError(f"{what} stopped before it listened on 127.0.0.1:{port}:\n{stopped}")
        time.sleep(0.3)
    raise AssertionError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s:\n{alive() or ''}")


class Containers:
    """The containers a test starts (by name), stopped and removed by `remove_all` whatever happened."""

    def __init__(self, podman: str, prefix: str):
        self.podman, self.prefix, self.names = podman, prefix, []

    def run(self, args: list[str]) -> str:
        name = args[args.index("--name") + 1]
        self.names.append(name)  # before it starts: a failed start may leave a created container behind
        done = subprocess.run([self.podman, *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed: {done.stderr}")
        return name

    def exec(self, name: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.podman, "exec", name, *argv], capture_output=True, text=True, timeout=timeout)

    def logs(self, name: str) -> str:
        done = subprocess.run([self.podman, "logs", name], capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr

    def running(self, name: str) -> bool:
        done = subprocess.run([self.podman, "inspect", "--format", "{{.State.Running}}", name], capture_output=True, text=True, timeout=60)
        return done.stdout.strip() == "true"

    def inspect(self, name: str) -> dict:
        done = subprocess.run([self.podman, "inspect", name], capture_output=True, text=True, timeout=60, check=True)
        return json.loads(done.stdout)[0]

    def stopped_log(self, name: str) -> str:
        """'' while the container runs; else its log's tail."""
        return "" if self.running(name) else self.logs(name)[-4000:]

    def remove_all(self) -> None:
        for name in reversed(self.names):
            subprocess.run([self.podman, "rm", "-f", "-t", "2", name], capture_output=True, timeout=120)
        self.names.clear()
