"""The Kubernetes manifests (deploy/kubernetes): every resource of the base and of the example
overlay is valid against the Kubernetes schemas (kubernetes-validate, strict: unknown fields are
errors), for the oldest and the newest Kubernetes version we name; and they agree with atoll
itself — every ATOLL_* variable they set is one atoll reads, the flags they pass exist, every
named port a probe or Service targets is declared, every Secret key they read is documented.
Nothing is applied to a cluster: these machines have no Kubernetes API server."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "deploy", "kubernetes", "base")
OVERLAY = os.path.join(ROOT, "deploy", "kubernetes", "overlays", "example")
DOC = os.path.join(ROOT, "docs", "deploy-kubernetes.md")
# the versions validated: the oldest one we support and the newest the validator knows
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def _kustomization(path: str) -> dict:
    with open(os.path.join(path, "kustomization.yaml")) as f:
        return yaml.safe_load(f)


def _base_resources() -> list[dict]:
    docs = []
    for name in _kustomization(BASE)["resources"]:
        with open(os.path.join(BASE, name)) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def _rendered(path: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (its built-in kustomize) is not installed; the base files are still validated")
    out = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _validate(doc: dict, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_kustomization_lists_every_manifest_of_the_base():
    files = {f for f in os.listdir(BASE) if f.endswith(".yaml") and f != "kustomization.yaml"}
    assert set(_kustomization(BASE)["resources"]) == files


@pytest.mark.parametrize("version", VERSIONS)
def test_every_base_resource_is_valid(version):
    docs = _base_resources()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["Namespace", "ConfigMap", "Deployment", "PersistentVolumeClaim", "Service", "Service"]
        + ["DaemonSet", "NetworkPolicy", "Deployment", "Service"]
    )
    for doc in docs:
        _validate(doc, version)


@pytest.mark.parametrize("path", [BASE, OVERLAY], ids=["base", "overlay"])
def test_the_rendered_manifests_are_valid(path):
    docs = _rendered(path)
    assert len(docs) == len(_base_resources())
    for doc in docs:
        assert doc["metadata"].get("namespace", "atoll") == "atoll"
        for version in VERSIONS:
            _validate(doc, version)
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "DaemonSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert len(images) == 1 and ":" in images.pop()  # the kustomize image is pinned to a tag


def test_the_validator_refuses_a_broken_manifest():
    """The checks above can fail: a misspelt field and a wrong type are errors."""
    dep = next(d for d in _base_resources() if d["kind"] == "Deployment")
    bad = copy.deepcopy(dep)
    bad["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad, VERSIONS[-1])
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad, VERSIONS[-1])


def _containers() -> list[dict]:
    return [
        c
        for d in _base_resources()
        if d["kind"] in ("Deployment", "DaemonSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def _atoll_variables() -> set[str]:
    names: set[str] = set()
    for top, _dirs, files in os.walk(os.path.join(ROOT, "src", "atoll")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(top, f)) as fh:
                    names |= set(re.findall(r"ATOLL_[A-Z0-9_]*[A-Z0-9]", fh.read()))
    return names


def test_every_variable_they_set_is_one_atoll_reads():
    known = _atoll_variables()
    config = next(d for d in _base_resources() if d["kind"] == "ConfigMap")
    used = set(config["data"])
    for c in _containers():
        used |= {e["name"] for e in c.get("env", ()) if e["name"].startswith("ATOLL_")}
    assert used and used <= known, sorted(used - known)


def test_the_commands_use_flags_atoll_has():
    from typer.main import get_command

    from atoll.cli.main import app

    cli = get_command(app)
    for c in _containers():
        argv = c["command"]
        assert argv[0] == "atoll"
        sub = cli.commands[argv[1]]  # type: ignore[attr-defined]
        flags = {o for p in sub.params for o in p.opts}
        assert {a for a in argv[2:] if a.startswith("--")} <= flags, argv


def test_named_ports_exist_and_secret_keys_are_documented():
    docs = _base_resources()
    with open(DOC) as f:
        doc_text = f.read()
    for c in _containers():
        names = {p["name"] for p in c.get("ports", ())}
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in names
        for e in c.get("env", ()):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "atoll-secrets"
                assert f"`{ref['key']}`" in doc_text, ref["key"]
    for svc in (d for d in docs if d["kind"] == "Service"):
        picked = [
            d
            for d in docs
            if d["kind"] in ("Deployment", "DaemonSet")
            and svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        pod_ports = {
            p["name"] for d in picked for c in d["spec"]["template"]["spec"]["containers"] for p in c["ports"]
        }
        assert picked and {p["targetPort"] for p in svc["spec"]["ports"]} <= pod_ports, svc["metadata"][
            "name"
        ]
