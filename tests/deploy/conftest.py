"""Fixtures of the deploy tests: the real tools, and the chart and manifests rendered by them.

- ``helm``, ``kubectl``: the static binaries `scripts/get-helm.sh` puts in ``.cache/bin`` (or ones
  on the PATH). A missing tool FAILS the test, naming the script that installs it.
- ``render_chart(*helm_args)``: ``helm template`` of charts/fedpipe, as parsed documents, on a cluster whose API
  server's address is given (``deploytools.CLUSTER``: the egress NetworkPolicy, on by default, needs it).
- ``build_kustomization(path)``: ``kubectl kustomize``, as parsed documents.
- ``kustomize_overlay``: a user's overlay of manifests/ with both components and another namespace.
- ``validate_k8s(docs)``: ``kubernetes-validate --strict`` against Kubernetes 1.30. It has no
  schema for CRD kinds and only warns about them; each of those (ServiceMonitor) must have a
  validator in CRD_VALIDATORS (the Prometheus Operator's models), which then runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from deploytools import (
    CHART,
    CLUSTER,
    CRD_VALIDATORS,
    GET_HELM,
    K8S_VERSION,
    NAMESPACE,
    RELEASE,
    SETUP_TEST,
    find_tool,
    parse_docs,
    run_tool,
    write_overlay,
)


@pytest.fixture(scope="session")
def helm() -> str:
    return find_tool("helm", GET_HELM)


@pytest.fixture(scope="session")
def kubectl() -> str:
    return find_tool("kubectl", GET_HELM)


@pytest.fixture(scope="session")
def render_chart(helm: str) -> Callable[..., list[dict]]:
    def render(*args: str) -> list[dict]:
        return parse_docs(run_tool([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *CLUSTER, *args]).stdout)

    return render


@pytest.fixture(scope="session")
def build_kustomization(kubectl: str) -> Callable[[Path], list[dict]]:
    def build(path: Path) -> list[dict]:
        return parse_docs(run_tool([kubectl, "kustomize", str(path)]).stdout)

    return build


@pytest.fixture(scope="session")
def kustomize_overlay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's overlay of manifests/ with both components and another namespace."""
    return write_overlay(
        tmp_path_factory.mktemp("kustomize"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        "namespace: team-a\n"
        "resources:\n  - ../manifests\n"
        "components:\n  - ../manifests/components/service-monitor\n  - ../manifests/components/schedule\n",
    )


@pytest.fixture(scope="session")
def validate_k8s(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[dict]], None]:
    tool = find_tool("kubernetes-validate", SETUP_TEST)
    folder = tmp_path_factory.mktemp("validate")

    def validate(docs: list[dict], versions: tuple[str, ...] = (K8S_VERSION,)) -> None:
        assert docs, "nothing was rendered"
        path = folder / "docs.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        for version in versions:
            proc = run_tool([tool, "--strict", "-k", version, "--quiet", str(path)], check=False)
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0 and "ERROR" not in output, f"Kubernetes {version}: {output}"
        warned = [line for line in output.splitlines() if line.startswith("WARN")]
        crd_docs = [doc for doc in docs if doc["kind"] in CRD_VALIDATORS]
        assert len(warned) == len(crd_docs) and all(any(f"kind {doc['kind']} " in line for line in warned) for doc in crd_docs), (
            f"kubernetes-validate has no schema for these, and nothing else validates them: {warned}"
        )
        for doc in crd_docs:
            CRD_VALIDATORS[doc["kind"]](doc)

    return validate
