"""Kubernetes MPIJob manifests (taco_notebook.cluster.launch.mpijob), checked without a cluster.

Every generated manifest is walked against the MPIJob CRD's own OpenAPI schema (kubeflow/mpi-operator's
``manifests/base/kubeflow.org_mpijobs.yaml``, stored in tests/data) and its pod templates against the kubernetes
client's models; deliberately broken ones must fail both. Bad options must raise MPIJobSpecError naming the
option and the fix.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from taco_notebook.cluster.launch.mpi import find_mpi, single_host_env
from taco_notebook.cluster.launch.mpijob import (
    _CONTROLLER_CHECK,
    ENGINE_DIR,
    ENGINE_FILE,
    MPIJobSpec,
    MPIJobSpecError,
    build_manifest,
    launcher_script,
    parse_hugepages,
    rank_env,
    rank_shell_command,
    to_yaml,
)

from ...support.k8s_checks import check_against_crd, check_object_meta, check_pod_template, crd_schema, model_mismatches
from ...support.mpirun import kill_session

CRD_FILE = Path(__file__).parents[2] / "data" / "kubeflow.org_mpijobs.yaml"
CONTROLLER: dict[str, Any] = {"controller_address": "10.0.0.5", "controller_port": 45123}
# (ranks, GPUs per node, hugepages, MPI) -> workers: 1x8, 2x8, 16 nodes x 8, with and without huge pages
SHAPES = [
    (8, 8, None, "OpenMPI", 1),
    (8, 8, "1Gi:50", "OpenMPI", 1),
    (16, 8, None, "OpenMPI", 2),
    (16, 8, "1Gi:50", "OpenMPI", 2),
    (16, 8, "2Mi:1024", "Intel", 2),
    (128, 8, "1Gi:50", "OpenMPI", 16),
    (4, 2, None, "OpenMPI", 2),
]


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader reads the 180 KB schema in ~0.2 s
    with open(CRD_FILE) as f:
        return dict(yaml.load(f, Loader=loader))


@pytest.fixture(scope="module")
def kubernetes_client() -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client (pip install kubernetes) checks pod templates")


def manifest(**options: Any) -> dict[str, Any]:
    return build_manifest(MPIJobSpec(**{**CONTROLLER, **options}))


def worker_container(job: dict[str, Any]) -> dict[str, Any]:
    return dict(job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0])


@pytest.mark.parametrize("np,gpus,hugepages,mpi,workers", SHAPES)
def test_manifest_passes_the_crd_schema_and_the_pod_models(crd: dict[str, Any], kubernetes_client: None, np: int,
                                                             gpus: int, hugepages: str | None, mpi: str,
                                                             workers: int) -> None:
    job = manifest(np=np, gpus_per_node=gpus, hugepages=hugepages, mpi_implementation=mpi)
    assert check_against_crd(job, crd) == []
    assert check_object_meta(job["metadata"]) == []
    for role, replica in job["spec"]["mpiReplicaSpecs"].items():
        assert check_pod_template(replica["template"]) == [], role
    assert yaml.safe_load(to_yaml(job)) == job  # the YAML round-trips, comments and literal blocks included
    check_shape(job, np, gpus, hugepages, mpi, workers)


def check_shape(job: dict[str, Any], np: int, gpus: int, hugepages: str | None, mpi: str, workers: int) -> None:
    """What the manifest must hold: slots, replicas, GPU and huge page resources, volumes, env, mpirun."""
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    assert job["spec"]["slotsPerWorker"] == gpus and job["spec"]["mpiImplementation"] == mpi
    replicas = job["spec"]["mpiReplicaSpecs"]
    assert replicas["Launcher"]["replicas"] == 1 and replicas["Worker"]["replicas"] == workers
    worker = worker_container(job)
    limits, requests = worker["resources"]["limits"], worker["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == str(gpus) and requests["memory"] == limits["memory"] == f"{8 * gpus}Gi"
    volumes = {v["name"]: v for v in replicas["Worker"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    if hugepages:
        size, count = hugepages.split(":")
        total = f"{int(size[:-2]) * int(count)}{size[-2:]}"
        assert limits[f"hugepages-{size}"] == requests[f"hugepages-{size}"] == total
        assert volumes[mounts["/dev/hugepages"]]["emptyDir"] == {"medium": "HugePages"}
    else:
        assert "/dev/hugepages" not in mounts and not any(k.startswith("hugepages-") for k in limits)
    secret = volumes[mounts["/etc/taco-engine"]]["secret"]
    assert secret["secretName"] == "taco-engine" and secret["defaultMode"] == 0o400
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["TACO_CONTROLLER_ADDR"] == "10.0.0.5" and env["TACO_CONTROLLER_PORT"] == "45123"
    assert env["TACO_GPUS"] == "auto" and env["TACO_CLUSTER_NAME"] == "taco"
    script = replicas["Launcher"]["template"]["spec"]["containers"][0]["command"][2]
    assert re.search(rf"exec mpirun -np {np}\b", script)
    assert f"--file=/etc/taco-engine/{ENGINE_FILE}" in script and '"--location=${TACO_CONTROLLER_ADDR}"' in script
    if mpi == "OpenMPI":  # ranks started over ssh do not inherit the pod's env: mpirun forwards each variable
        assert all(f"-x {name}" in script for name in env)


def test_launcher_script_is_valid_sh_and_a_custom_command_replaces_the_engine() -> None:
    shell = shutil.which("sh")
    assert shell is not None
    for options in ({}, {"command": ("python", "train.py", "--epochs", "3 4")}, {"mpi_implementation": "Intel"}):
        script = launcher_script(MPIJobSpec(np=16, **CONTROLLER, **options))  # type: ignore[arg-type]
        parsed = subprocess.run([shell, "-n", "-c", script], capture_output=True, text=True, timeout=30)
        assert parsed.returncode == 0, parsed.stderr
    job = manifest(np=8, command=("python", "train.py"))
    script = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"][2]
    assert script.rstrip().endswith("python train.py") and "ipyparallel" not in script
    assert "/etc/taco-engine" not in str(job["spec"]["mpiReplicaSpecs"]["Worker"])  # no engine, no Secret
    assert "create secret" not in to_yaml(job) and "create secret generic taco-engine" in to_yaml(manifest(np=8))


def test_launcher_checks_the_controller_is_reachable() -> None:
    """The check the launcher runs first, for real: against a listening socket and a closed port."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        env = {"TACO_CONTROLLER_ADDR": "127.0.0.1", "TACO_CONTROLLER_PORT": str(port)}
        ok = subprocess.run([sys.executable, "-c", _CONTROLLER_CHECK], env=env, capture_output=True, text=True,
                            timeout=60)
        assert ok.returncode == 0, ok.stderr
    closed = subprocess.run([sys.executable, "-c", _CONTROLLER_CHECK], env=env, capture_output=True, text=True,
                            timeout=60)
    assert closed.returncode == 1
    assert f"the notebook controller at 127.0.0.1:{port} is unreachable from this pod" in closed.stderr


def _rank_info() -> tuple[int, str]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), os.environ["TACO_CLUSTER_NAME"]


@pytest.mark.cluster
def test_the_ranks_command_registers_engines_with_the_notebooks_controller(tmp_path: Path) -> None:
    """What every worker slot runs, for real here: mpiexec starts the manifest's engine command, which reads the
    connection file from where the Secret is mounted (here a private copy) and registers with a controller,
    engine id = MPI rank, the TACO_* variables in its environment. Only Kubernetes itself is left out."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=0, profile_dir=str(tmp_path / "profile"), controller_ip="127.0.0.1", log_level=40)
    cluster.start_controller_sync()
    proc = None
    try:
        engine_file = tmp_path / "profile" / "security" / f"ipcontroller-{cluster.cluster_id}-engine.json"
        deadline = time.monotonic() + 60
        while not engine_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        secret = tmp_path / "secret"
        secret.mkdir(mode=0o700)
        shutil.copy(engine_file, secret / ENGINE_FILE)
        spec = MPIJobSpec(np=2, gpus_per_node=1, controller_address="127.0.0.1",
                          controller_port=json.loads(engine_file.read_text())["registration"])
        info = find_mpi(single_host=True)
        ranks = rank_shell_command(spec).replace(f"{ENGINE_DIR}/{ENGINE_FILE}", str(secret / ENGINE_FILE))
        line = f"exec {shlex.join([info.mpiexec, *info.extra_args])} -n 2 {ranks}"
        env = {**os.environ, **info.environment, **single_host_env(info), **rank_env(spec)}
        # the manifest runs the image's `python`: here this venv's (pytest may run without an activated venv)
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        proc = subprocess.Popen(["sh", "-c", line], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = cluster.connect_client_sync()
        client.wait_for_engines(2, timeout=120)
        assert sorted(client[:].apply_sync(_rank_info)) == [(0, "taco"), (1, "taco")]
        client.shutdown(hub=False, block=True)
        client.close()
        proc.wait(timeout=60)
    finally:
        if proc is not None and proc.returncode is None:
            kill_session(proc)  # its own session and what it started: only what this test started
        cluster.stop_controller_sync()


def broken(job: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``job`` with ``value`` at the dotted ``path`` (``[n]`` indexes lists; ``None`` deletes)."""
    job = copy.deepcopy(job)
    keys = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)]
    parent: Any = job
    for key in keys[:-1]:
        parent = parent[key]
    if value is None:
        del parent[keys[-1]]
    else:
        parent[keys[-1]] = value
    return job


WORKER = "spec.mpiReplicaSpecs.Worker"
CONTAINER = f"{WORKER}.template.spec.containers[0]"
BROKEN: list[tuple[str, Any, str]] = [
    ("spec.slotsPerNode", 8, "spec.slotsPerNode: unknown field"),
    ("spec.slotsPerWorker", "8", "spec.slotsPerWorker: must be integer"),
    ("spec.mpiImplementation", "MPICH", "spec.mpiImplementation: 'MPICH' is not one of"),
    (f"{WORKER}.replicas", 2**40, f"{WORKER}.replicas: 1099511627776 is out of int32 range"),
    (f"{CONTAINER}.imagePolicy", "Always", f"{CONTAINER}.imagePolicy: unknown field"),
    (f"{CONTAINER}.resources.limits.memory", "lots", f"{CONTAINER}.resources.limits.memory: 'lots' does not match"),
    (f"{CONTAINER}.resources.requests.memory", True, "must be an integer or a string, got bool"),
    (f"{CONTAINER}.volumeMounts[0].mountPath", None, "mountPath: required field missing"),
    (f"{WORKER}.template.spec.containers", None, f"{WORKER}.template.spec.containers: required field missing"),
    (f"{WORKER}.template.spec.volumes[0].emptyDir", "Memory", "emptyDir: must be object"),
    ("spec.mpiReplicaSpecs", None, "spec.mpiReplicaSpecs: required field missing"),
    ("apiVersion", "kubeflow.org/v1", "apiVersion/kind: the CRD serves no version 'v1'"),
]


def test_broken_manifests_fail_the_crd_schema(crd: dict[str, Any]) -> None:
    good = manifest(np=16, hugepages="1Gi:50")
    assert check_against_crd(good, crd) == []
    for path, value, expected in BROKEN:
        problems = check_against_crd(broken(good, path, value), crd)
        assert any(expected in problem for problem in problems), (path, value, problems)


BROKEN_TEMPLATES: list[tuple[str, Any, str]] = [
    ("spec.containers[0].imagePolicy", "Always", "spec.containers[0].imagePolicy: unknown field"),
    ("spec.volumes[1].emptyDir.mediums", "HugePages", "spec.volumes[1].emptyDir.mediums: unknown field"),
    ("spec.containers[0].name", None, "V1Container"),
    ("spec.containers[0].volumeMounts", "/dev/shm", "validation error for V1VolumeMount"),
]


def test_broken_pod_templates_fail_the_kubernetes_models(kubernetes_client: None) -> None:
    template = manifest(np=16, hugepages="1Gi:50")["spec"]["mpiReplicaSpecs"]["Worker"]["template"]
    assert check_pod_template(template) == []
    for path, value, expected in BROKEN_TEMPLATES:
        problems = check_pod_template(broken(template, path, value))
        assert any(expected in problem for problem in problems), (path, value, problems)


def count_fields(schema: Any) -> int:
    """How many named fields a schema has, at every depth."""
    if isinstance(schema, list):
        return sum(count_fields(item) for item in schema)
    if not isinstance(schema, dict):
        return 0
    return len(schema.get("properties", {})) + sum(count_fields(item) for item in schema.values())


def test_the_stored_crd_matches_the_kubernetes_models(crd: dict[str, Any], kubernetes_client: None) -> None:
    """Every field of the CRD's pod template exists in the client's models with the same type: the CRD copy
    in tests/data has no mistyped or misplaced field (both are generated from Kubernetes' Go types)."""
    schema = crd_schema(crd, "kubeflow.org/v2beta1", "MPIJob")
    template = schema["properties"]["spec"]["properties"]["mpiReplicaSpecs"]["additionalProperties"]
    template = template["properties"]["template"]
    assert list(model_mismatches(template, "V1PodTemplateSpec")) == []
    assert count_fields(template) > 900  # the whole PodTemplateSpec was compared, not a stub of it
    mistyped = copy.deepcopy(template)
    container = mistyped["properties"]["spec"]["properties"]["containers"]["items"]
    container["properties"]["imagePolicy"] = {"type": "string"}
    assert list(model_mismatches(mistyped, "V1PodTemplateSpec")) == [
        "spec.containers[].imagePolicy: not a field of V1Container"]


BAD_OPTIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"gpus_per_node": 0}, "--gpus-per-node", "must be a positive number of GPUs per node, got 0"),
    ({"gpus_per_node": -8}, "--gpus-per-node", "got -8"),
    ({"gpus_per_node": True}, "--gpus-per-node", "got True"),
    ({"np": 12}, "-np", "12 ranks do not fill nodes of 8 GPUs (--gpus-per-node): use -np 8 or 16"),
    ({"np": 4}, "-np", "use -np 8, or a --gpus-per-node that divides 4"),
    ({"np": 0}, "-np", "must be a positive number of ranks, got 0"),
    ({"hugepages": "1G:50"}, "--hugepages", "expected SIZE:COUNT with SIZE one of 1Gi, 2Mi"),
    ({"hugepages": "1Gi"}, "--hugepages", "for example 1Gi:50; got '1Gi'"),
    ({"hugepages": "1Gi:0"}, "--hugepages", "the page count must be positive, got 0"),
    ({"hugepages": "1Gi:many"}, "--hugepages", "expected SIZE:COUNT"),
    ({"image_pull_policy": "always"}, "--image-pull-policy", "'always' is not one of Always, IfNotPresent, Never"),
    ({"image": "my image"}, "--image", "expected an image reference"),
    ({"name": "Taco"}, "--name", "'Taco' is not a DNS-1123 label"),
    ({"name": "taco_run"}, "--name", "is not a DNS-1123 label"),
    ({"name": "run-"}, "--name", "is not a DNS-1123 label"),
    ({"name": "1run"}, "--name", "must start with a letter"),
    ({"name": "t" * 51}, "--name", "at most 50 characters"),
    ({"namespace": "Team A"}, "--namespace", "is not a DNS-1123 label"),
    ({"controller_address": ""}, "--controller-address", "expected the host name or IP address"),
    ({"controller_address": "tcp://10.0.0.5"}, "--controller-address", "got 'tcp://10.0.0.5'"),
    ({"controller_port": 0}, "--controller-port", "registration port (1-65535), got 0"),
    ({"memory_per_worker": "lots"}, "--memory-per-worker", "expected a Kubernetes quantity"),
    ({"mpi_implementation": "MPICH"}, "--mpi", "runs OpenMPI or Intel"),
    ({"command": "python train.py"}, "command", "a non-empty list of words, for example ['python', 'train.py']"),
    ({"command": ()}, "command", "got ()"),
]


def test_bad_options_are_clear_errors() -> None:
    for options, option, fix in BAD_OPTIONS:
        with pytest.raises(MPIJobSpecError) as caught:
            MPIJobSpec(**{"np": 16, **CONTROLLER, **options})
        message = str(caught.value)
        assert caught.value.option == option and isinstance(caught.value, ValueError), (options, message)
        assert message.startswith(f"{option}: ") and fix in message, (options, message)


def test_hugepages_parse() -> None:
    assert parse_hugepages("1Gi:50").resource == "hugepages-1Gi" and parse_hugepages("1Gi:50").quantity == "50Gi"
    assert parse_hugepages(" 2Mi : 1024 ").quantity == "2048Mi"
