"""The Kubernetes manifests (deploy/k8s/) validate against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields are errors), and say what the deployment needs: broker and gateway Deployments with
Services that select them, GPU workers with nvidia.com/gpu, readiness and liveness probes (on /health where
that is the right question), settings that the table knows with values it accepts, commands the CLI takes."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill.cli.main import build_parser
from tokenmill.cli.settings import SETTINGS

kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="kubernetes-validate checks the manifests (a dev dependency)")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
VERSION = "1.30.0"  # the oldest Kubernetes the manifests target; every field used is older


def _docs() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def _by(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in _docs() if d["kind"] == kind}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize(("name", "doc"), _docs(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_manifest_validates_against_the_schema(name: str, doc: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    dep = copy.deepcopy(_by("Deployment")["tokenmill-gateway"])
    _container(dep)["readinessProbe"]["httpGet"]["paht"] = "/health"  # a typo: unknown in strict mode
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSION, strict=True)
    dep = copy.deepcopy(_by("Deployment")["tokenmill-broker"])
    dep["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, VERSION, strict=True)


def test_broker_gateway_and_workers() -> None:
    deps, svcs = _by("Deployment"), _by("Service")
    assert set(deps) == {"tokenmill-broker", "tokenmill-gateway", "tokenmill-worker"}
    assert set(svcs) == {"tokenmill-broker", "tokenmill-gateway"}
    for name, svc in svcs.items():  # each Service selects its Deployment's pods, on ports they name
        labels = deps[name]["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert deps[name]["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
        named = {p["name"] for p in _container(deps[name])["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named
    assert deps["tokenmill-broker"]["spec"]["replicas"] == 1
    assert deps["tokenmill-broker"]["spec"]["strategy"]["type"] == "Recreate"
    for name in ("tokenmill-broker", "tokenmill-gateway"):  # drain: jobs in flight, open streams (30 s each)
        assert deps[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 30, name
    worker = _container(deps["tokenmill-worker"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    gateway = _container(deps["tokenmill-gateway"])
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] in ("/health", "/ping")
    assert "/health" in " ".join(worker["livenessProbe"]["exec"]["command"])
    for dep in deps.values():
        c = _container(dep)
        assert {"readinessProbe", "livenessProbe"} & set(c) and "livenessProbe" in c


def _probe_commands(c: dict[str, Any]) -> list[list[str]]:
    out = []
    for key in ("readinessProbe", "livenessProbe", "startupProbe"):
        cmd = c.get(key, {}).get("exec", {}).get("command")
        if cmd:
            out.append(shlex.split(cmd[2]) if cmd[:2] == ["sh", "-c"] else cmd)
    return out


def test_commands_and_settings_are_the_clis() -> None:
    """Each container runs a tokenmill command with settings of that command (valid values), and each exec
    probe is a `tokenmill health` the parser takes."""
    by_env = {s.env: s for s in SETTINGS}
    parser = build_parser()
    for dep in _by("Deployment").values():
        c = _container(dep)
        assert c["command"][0] == "tokenmill"
        command = c["command"][1]
        for e in c["env"]:
            s = by_env[e["name"]]
            assert command in s.commands, (command, e["name"])
            if "value" in e:
                s.kind.parse(e["value"])
        for probe in _probe_commands(c):
            assert probe[:2] == ["tokenmill", "health"], probe
            args = parser.parse_args([a.replace("$TOKENMILL_WORKER_NAME", "w") for a in probe[1:]])
            assert args.url or args.broker
