"""The deployment files: every Kubernetes manifest in deploy/k8s/ and the Dockerfile.

The probes must point at paths the admin endpoint really serves (imported from
kalos.server.admin, so the two cannot drift apart) on the port the sidecar's own
``--admin-port`` argument gives; the sidecar's arguments must parse with the real CLI.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from kalos.cli import build_parser  # noqa: E402
from kalos.server.admin import ADMIN_HOST, HEALTHZ_PATH, PATHS, READYZ_PATH  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
WORKLOADS = ("Pod", "Deployment", "StatefulSet", "DaemonSet", "Job")
PROBE_URL = re.compile(r"http://([0-9.]+):(\d+)(/[A-Za-z0-9_/-]*)")


def pod_specs() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(file name, workload document, pod spec) of every workload in every manifest."""
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in WORKLOADS:
                spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
                out.append((path.name, doc, spec))
    return out


SPECS = pod_specs()
IDS = [f"{name}:{doc['metadata']['name']}" for name, doc, _ in SPECS]


def sidecar_of(spec: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in spec.get("initContainers", []) if c.get("args", [None])[0] == "serve"]
    assert len(found) == 1, "exactly one initContainer runs `kalos serve`"
    return found[0]


def serve_args(container: dict[str, Any]) -> Any:
    """The sidecar's arguments, parsed by the real `kalos` parser (unknown flags fail)."""
    return build_parser().parse_args(container["args"])


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def probe_target(probe: dict[str, Any]) -> tuple[str, int, str]:
    """(host, port, path) a probe checks: an httpGet, or an exec that GETs a URL."""
    if "httpGet" in probe:
        get = probe["httpGet"]
        return get.get("host", "<pod IP>"), int(get["port"]), get["path"]
    match = PROBE_URL.search(" ".join(probe["exec"]["command"]))
    assert match, f"the probe fetches no http URL: {probe}"
    return match.group(1), int(match.group(2)), match.group(3)


def test_there_are_manifests() -> None:
    assert MANIFESTS and SPECS
    assert any("cuda" in serve_args(sidecar_of(spec)).device for _, _, spec in SPECS)


@pytest.mark.parametrize(("name", "doc", "spec"), SPECS, ids=IDS)
def test_the_sidecar_is_a_native_sidecar(name: str, doc: dict, spec: dict) -> None:
    kalos = sidecar_of(spec)
    assert kalos["restartPolicy"] == "Always"  # an initContainer that keeps running
    assert spec["containers"], "an app container runs beside it"
    assert all(c.get("restartPolicy") is None for c in spec["containers"])


@pytest.mark.parametrize(("name", "doc", "spec"), SPECS, ids=IDS)
def test_probes_hit_the_admin_paths_on_the_admin_port(name: str, doc: dict, spec: dict) -> None:
    kalos = sidecar_of(spec)
    args = serve_args(kalos)
    assert not args.no_admin and args.admin_port, "the sidecar serves its admin endpoint"
    expected = {
        "startupProbe": READYZ_PATH,
        "readinessProbe": READYZ_PATH,
        "livenessProbe": HEALTHZ_PATH,
    }
    for kind, path in expected.items():
        host, port, probed = probe_target(kalos[kind])
        assert probed in PATHS and probed == path, kind
        assert port == args.admin_port, kind
        # The endpoint listens on the loopback only: the probe must run inside the pod.
        assert host == ADMIN_HOST, kind
        assert "exec" in kalos[kind], f"{kind}: kubelet's httpGet cannot reach {ADMIN_HOST}"


@pytest.mark.parametrize(("name", "doc", "spec"), SPECS, ids=IDS)
def test_the_socket_volume_is_memory_backed_and_shared(name: str, doc: dict, spec: dict) -> None:
    kalos = sidecar_of(spec)
    runtime = env_of(kalos)["KALOS_RUNTIME_DIR"]
    assert serve_args(kalos).runtime_dir is None  # the environment decides, for both sides
    volumes = {v["name"]: v for v in spec["volumes"]}

    def socket_mount(container: dict[str, Any]) -> tuple[str, str]:
        mounts = [
            (m["name"], m["mountPath"])
            for m in container["volumeMounts"]
            if runtime == m["mountPath"] or runtime.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        assert len(mounts) == 1, f"{container['name']}: one volume holds {runtime}"
        return mounts[0]

    theirs = socket_mount(kalos)
    assert volumes[theirs[0]]["emptyDir"]["medium"] == "Memory"
    for app in spec["containers"]:
        assert socket_mount(app) == theirs, "mounted at the same path in both containers"
        assert env_of(app)["KALOS_RUNTIME_DIR"] == runtime


@pytest.mark.parametrize(("name", "doc", "spec"), SPECS, ids=IDS)
def test_one_non_root_uid_and_read_only_roots(name: str, doc: dict, spec: dict) -> None:
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    for c in [sidecar_of(spec), *spec["containers"]]:
        ctx = c.get("securityContext", {})
        # SO_PEERCRED: the app's uid must be the sidecar's (no per-container override).
        assert ctx.get("runAsUser", pod["runAsUser"]) == pod["runAsUser"], c["name"]
        assert ctx["readOnlyRootFilesystem"] is True, c["name"]
        assert ctx["allowPrivilegeEscalation"] is False, c["name"]


@pytest.mark.parametrize(("name", "doc", "spec"), SPECS, ids=IDS)
def test_resources_and_the_data_dir(name: str, doc: dict, spec: dict) -> None:
    kalos = sidecar_of(spec)
    args = serve_args(kalos)
    limits = kalos["resources"]["limits"]
    assert "memory" in limits and "cpu" in limits
    if args.device.startswith("cuda"):
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert int(kalos["resources"]["requests"]["nvidia.com/gpu"]) >= 1
    assert args.data_dir, "the sidecar keeps a data directory"
    mounts = {m["mountPath"]: m["name"] for m in kalos["volumeMounts"]}
    volume = mounts[args.data_dir]
    claims = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert (
        volume in claims
        or "persistentVolumeClaim" in volumes.get(volume, {})
        or (
            "emptyDir" in volumes.get(volume, {})
            and volumes[volume]["emptyDir"].get("medium") != "Memory"
        )
    ), "the data directory is on a disk-backed volume"
    # A clean stop takes a final snapshot: a grace period above the default 30 s.
    assert spec["terminationGracePeriodSeconds"] > 30


def test_the_dockerfile_runs_kalos_serve_as_non_root() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}", text, re.M)
    assert "ARG PYTHON_IMAGE=python:3.12-slim" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].split(":")[0].isdigit()  # numeric: runAsNonRoot can check it
    assert re.search(r'^ENTRYPOINT \["kalos"\]', text, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.admin_port
    assert "ARG KALOS_EXTRAS" in text  # the gpu extra as a build arg


@pytest.mark.parametrize(("name", "doc", "spec"), SPECS, ids=IDS)
def test_a_source_connection_string_comes_from_a_mounted_secret(
    name: str, doc: dict, spec: dict
) -> None:
    kalos = sidecar_of(spec)
    args = serve_args(kalos)
    assert args.source is None, "never on the command line (visible to every user of the host)"
    assert "KALOS_SOURCE" not in env_of(kalos), "never a plain env value"
    if args.source_file is None:
        return
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = [m for m in kalos["volumeMounts"] if args.source_file.startswith(m["mountPath"] + "/")]
    assert len(mounts) == 1 and "secret" in volumes[mounts[0]["name"]], "a Secret mounted as a file"
    assert mounts[0].get("readOnly") is True
    app_volumes = {m["name"] for app in spec["containers"] for m in app.get("volumeMounts", [])}
    assert mounts[0]["name"] not in app_volumes, "the app container does not see it"


def test_there_is_a_manifest_of_replicas_on_a_source_database() -> None:
    assert any(serve_args(sidecar_of(spec)).source_file for _, _, spec in SPECS)
