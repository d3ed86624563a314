"""Kubernetes MPIJob manifests (Kubeflow MPI Operator, ``kubeflow.org/v2beta1``) whose ranks are a cluster's engines.

The ``mpijob`` profile: instead of starting ranks itself, the notebook prints (or writes) a manifest that a
Kubernetes cluster with the MPI Operator runs. The launcher pod runs ``mpirun`` over the worker pods (one per
node, ``slotsPerWorker`` = GPUs per node, each asking for its GPUs and, with ``hugepages``, for 1 GiB or
2 MiB huge pages mounted at ``/dev/hugepages``, where :mod:`taco_notebook.comm.transport.shm` finds them), and every
rank is an ipyparallel engine that registers with the notebook's controller::

    spec = MPIJobSpec(np=16, gpus_per_node=8, hugepages="1Gi:50", controller_address="10.0.0.5",
                      controller_port=45123, image="registry.example/taco:0.1")
    print(to_yaml(build_manifest(spec)))

The engines read the controller's connection file (``ipcontroller-engine.json``: addresses, ports and the key
that signs every message) from the Secret :attr:`MPIJobSpec.engine_secret`, never from the manifest, which can
then be shown, kept and shared. The controller must listen where the pods reach it (``controller_address``,
``controller_port`` = its registration port); the launcher checks that first and fails with that message.
Bad options raise :class:`MPIJobSpecError` naming the option and the fix (the magic turns it into a
``UsageError``). No IPython import: this module is usable from scripts and tests.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["MPIJobSpec", "MPIJobSpecError", "HugePages", "build_manifest", "to_yaml", "parse_hugepages",
           "rank_env", "rank_command", "rank_shell_command", "launcher_script",
           "PULL_POLICIES", "MPI_IMPLEMENTATIONS", "ENGINE_DIR", "ENGINE_FILE"]

API_VERSION = "kubeflow.org/v2beta1"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
MPI_IMPLEMENTATIONS = ("OpenMPI", "Intel")  # the v2beta1 CRD's enum for spec.mpiImplementation
HUGEPAGE_SIZES = ("1Gi", "2Mi")  # what x86-64 nodes offer; the resource is hugepages-<size>
ENGINE_DIR = "/etc/taco-engine"
ENGINE_FILE = "ipcontroller-engine.json"
DEFAULT_IMAGE = "taco-notebook:0.1.0"
WORKER_SSHD = ("/usr/sbin/sshd", "-De")  # MPI Operator v2: workers run sshd, the launcher's mpirun ssh-es in
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)([KMGTPE]i|[numkMGTPE])?")
_POD_SUFFIX_ROOM = len("-worker-99999")  # the operator names pods <name>-launcher, <name>-worker-<i>: 63 in all


class MPIJobSpecError(ValueError):
    """A bad MPIJob option; ``option`` is the magic's flag for it (``"--gpus-per-node"``)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


@dataclass(frozen=True)
class HugePages:
    """``count`` huge pages of ``size`` (``"1Gi"`` or ``"2Mi"``) per worker pod."""

    size: str
    count: int

    @property
    def resource(self) -> str:
        """The Kubernetes resource name, ``hugepages-1Gi``."""
        return f"hugepages-{self.size}"

    @property
    def quantity(self) -> str:
        """The total as a Kubernetes quantity: 50 pages of 1Gi are ``"50Gi"``."""
        number, unit = int(self.size[:-2]), self.size[-2:]
        return f"{number * self.count}{unit}"


def parse_hugepages(text: str) -> HugePages:
    """``"1Gi:50"`` (size:count per worker) as :class:`HugePages`; :class:`MPIJobSpecError` when malformed.

    >>> parse_hugepages("2Mi:1024").quantity
    '2048Mi'
    """
    match = re.fullmatch(r"\s*(\w+)\s*:\s*([-+]?\d+)\s*", text or "")
    if not match or match.group(1) not in HUGEPAGE_SIZES:
        raise MPIJobSpecError("--hugepages", f"expected SIZE:COUNT with SIZE one of {', '.join(HUGEPAGE_SIZES)} "
                                             f"and COUNT the pages per worker, for example 1Gi:50; got {text!r}")
    count = int(match.group(2))
    if count <= 0:
        raise MPIJobSpecError("--hugepages", f"the page count must be positive, got {count} in {text!r}; "
                                             "leave --hugepages out for workers without huge pages")
    return HugePages(match.group(1), count)


@dataclass(frozen=True)
class MPIJobSpec:
    """What an MPIJob of engines needs. ``np`` ranks on ``np // gpus_per_node`` worker pods.

    ``controller_address``/``controller_port``: where the pods reach the notebook's ipyparallel controller
    (its registration port). ``hugepages``: ``"1Gi:50"`` or None. ``cpu_per_worker``/``memory_per_worker``:
    Kubernetes quantities (memory defaults to 8Gi per GPU; a memory request is also what Kubernetes demands
    beside huge pages). ``command``: what each rank runs; None runs an ipyparallel engine.
    ``mpi_implementation``: the MPI the image's ``mpirun`` is (the CRD's choices).
    """

    np: int
    controller_address: str
    controller_port: int
    gpus_per_node: int = 8
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    hugepages: str | None = None
    name: str = "taco"
    namespace: str = "default"
    cpu_per_worker: str | None = None
    memory_per_worker: str | None = None
    command: tuple[str, ...] | None = None
    mpi_implementation: str = "OpenMPI"

    def __post_init__(self) -> None:
        _check_counts(self.np, self.gpus_per_node)
        _check_names(self.name, self.namespace)
        _check_image(self.image, self.image_pull_policy)
        _check_controller(self.controller_address, self.controller_port)
        for option, quantity in (("--cpu-per-worker", self.cpu_per_worker),
                                 ("--memory-per-worker", self.memory_per_worker)):
            if quantity is not None and not _QUANTITY.fullmatch(str(quantity)):
                raise MPIJobSpecError(option, f"expected a Kubernetes quantity such as 16, 500m or 64Gi, "
                                              f"got {quantity!r}")
        if self.hugepages is not None:
            parse_hugepages(self.hugepages)
        if self.mpi_implementation not in MPI_IMPLEMENTATIONS:
            raise MPIJobSpecError("--mpi", f"the MPI Operator runs {' or '.join(MPI_IMPLEMENTATIONS)}, "
                                           f"got {self.mpi_implementation!r}")
        if self.command is not None and (isinstance(self.command, str) or not self.command
                                         or not all(isinstance(a, str) for a in self.command)):
            raise MPIJobSpecError("command", f"expected the rank's command as a non-empty list of words, "
                                             f"for example ['python', 'train.py'], got {self.command!r}")

    @property
    def workers(self) -> int:
        """Worker pods, one per node."""
        return self.np // self.gpus_per_node

    @property
    def engine_secret(self) -> str:
        """The Secret holding the controller's ``ipcontroller-engine.json``, mounted on every worker."""
        return f"{self.name}-engine"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_counts(np: object, gpus_per_node: object) -> None:
    if not _is_int(gpus_per_node) or gpus_per_node <= 0:  # type: ignore[operator]
        raise MPIJobSpecError("--gpus-per-node", f"must be a positive number of GPUs per node, got "
                                                 f"{gpus_per_node!r}: MPIJob workers are GPU nodes, one rank "
                                                 "per GPU (use --profile hosts or local for CPU ranks)")
    if not _is_int(np) or np <= 0:  # type: ignore[operator]
        raise MPIJobSpecError("-np", f"must be a positive number of ranks, got {np!r}")
    assert isinstance(np, int) and isinstance(gpus_per_node, int)
    if np % gpus_per_node:
        lower, upper = np - np % gpus_per_node, np - np % gpus_per_node + gpus_per_node
        choices = f"-np {lower} or {upper}" if lower else f"-np {upper}"
        raise MPIJobSpecError("-np", f"{np} ranks do not fill nodes of {gpus_per_node} GPUs (--gpus-per-node): "
                                     f"use {choices}, or a --gpus-per-node that divides {np}")


def _check_names(name: object, namespace: object) -> None:
    for option, value, room in (("--name", name, _POD_SUFFIX_ROOM), ("--namespace", namespace, 0)):
        if not isinstance(value, str) or not _DNS1123_LABEL.fullmatch(value) or len(value) > 63 - room:
            raise MPIJobSpecError(option, f"{value!r} is not a DNS-1123 label of at most {63 - room} characters "
                                          "(lowercase letters, digits and '-', starting and ending with a letter "
                                          "or digit), for example 'taco-run1'")
    if not name[0].isalpha():  # type: ignore[index]
        raise MPIJobSpecError("--name", f"{name!r} must start with a letter: the MPI Operator names a Service "
                                        "after the job, and Service names do (for example 'taco-run1')")


def _check_image(image: object, policy: object) -> None:
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise MPIJobSpecError("--image", f"expected an image reference such as registry.example/taco:0.1, "
                                         f"got {image!r}")
    if policy not in PULL_POLICIES:
        raise MPIJobSpecError("--image-pull-policy", f"{policy!r} is not one of {', '.join(PULL_POLICIES)}")


def _check_controller(address: object, port: object) -> None:
    if not isinstance(address, str) or not address or any(c.isspace() or c in "/:" for c in address):
        raise MPIJobSpecError("--controller-address", f"expected the host name or IP address at which the pods "
                                                      f"reach the notebook's controller, got {address!r}")
    if not _is_int(port) or not 0 < port < 65536:  # type: ignore[operator]
        raise MPIJobSpecError("--controller-port", f"expected the controller's registration port (1-65535), "
                                                   f"got {port!r}")


def _labels(spec: MPIJobSpec, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "taco-notebook", "app.kubernetes.io/instance": spec.name}
    if role:
        labels["app.kubernetes.io/component"] = role
    return labels


def rank_env(spec: MPIJobSpec) -> dict[str, str]:
    """The ``TACO_*`` variables every rank gets (forwarded by ``mpirun``, since ranks started over ssh do not
    inherit the pod's environment): the cluster's name, GPU placement, and where the controller is."""
    return { "TACO_CLUSTER_NAME": spec.name,
        "TACO_GPUS": "auto",  # one GPU per local rank (comm/group/placement.py)
        "TACO_CONTROLLER_ADDR": spec.controller_address,
        "TACO_CONTROLLER_PORT": str(spec.controller_port),
    }


def rank_command(spec: MPIJobSpec) -> list[str]:
    """What ``mpirun`` starts on each slot: the spec's command, else an engine of the notebook's controller."""
    if spec.command is not None:
        return list(spec.command)
    return ["python", "-m", "ipyparallel.engine", "--mpi", f"--file={ENGINE_DIR}/{ENGINE_FILE}",
            "--location=${TACO_CONTROLLER_ADDR}"]


# Run first on the launcher: an unreachable controller otherwise shows up as engines that never register.
_CONTROLLER_CHECK = """\
import os, socket, sys
address, port = os.environ["TACO_CONTROLLER_ADDR"], int(os.environ["TACO_CONTROLLER_PORT"])
try:
    socket.create_connection((address, port), timeout=30).close()
except OSError as exc:
    sys.exit(f"taco: the notebook controller at {address}:{port} is unreachable from this pod ({exc}): "
             "start it listening on an address the pods reach and give that address and its port")
"""


def launcher_script(spec: MPIJobSpec) -> str:
    """The launcher's shell script: check the controller, then ``mpirun`` the ranks over the workers."""
    env = rank_env(spec)
    if spec.mpi_implementation == "OpenMPI":
        forward = [arg for name in env for arg in ("-x", name)]
        mpirun = ["mpirun", "-np", str(spec.np), "--bind-to", "none", *forward]
    else:  # Intel MPI's hydra forwards the whole environment with -genvall
        mpirun = ["mpirun", "-np", str(spec.np), "-ppn", str(spec.gpus_per_node), "-genvall"]
    return (f"set -e\npython -c {shlex.quote(_CONTROLLER_CHECK)}\n"
            f"exec {shlex.join(mpirun)} {rank_shell_command(spec)}\n")


def rank_shell_command(spec: MPIJobSpec) -> str:
    """:func:`rank_command` as ``sh`` words, ``${TACO_*}`` left for the launcher's shell to expand."""
    return " ".join(_shell_word(arg) for arg in rank_command(spec))


def _shell_word(arg: str) -> str:
    """Quote ``arg`` for sh but leave ``${TACO_*}`` references for the launcher's shell to expand."""
    if "${TACO_" in arg:
        return '"' + re.sub(r'(["\\`])', r"\\\1", arg) + '"'
    return shlex.quote(arg)


def _env_list(env: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in env.items()]


def _launcher(spec: MPIJobSpec) -> dict[str, Any]:
    env = rank_env(spec)
    if spec.mpi_implementation == "OpenMPI":  # the operator's images run as root; Open MPI refuses without these
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    container = {
        "name": "launcher", "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
        "command": ["/bin/sh", "-c", launcher_script(spec)], "env": _env_list(env),
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
    }
    return {"replicas": 1, "restartPolicy": "Never",
            "template": {"metadata": {"labels": _labels(spec, "launcher")},
                         "spec": {"restartPolicy": "Never", "containers": [container],
                                  "enableServiceLinks": False, "automountServiceAccountToken": False}}}


def _worker_resources(spec: MPIJobSpec) -> dict[str, dict[str, str]]:
    memory = spec.memory_per_worker or f"{8 * spec.gpus_per_node}Gi"
    limits = {"nvidia.com/gpu": str(spec.gpus_per_node), "memory": memory}
    requests = {"memory": memory}  # Kubernetes requires a memory (or cpu) request beside huge pages
    if spec.cpu_per_worker is not None:
        limits["cpu"] = requests["cpu"] = str(spec.cpu_per_worker)
    if spec.hugepages is not None:
        pages = parse_hugepages(spec.hugepages)
        limits[pages.resource] = requests[pages.resource] = pages.quantity  # huge page requests equal limits
    return {"limits": limits, "requests": requests}


def _worker_volumes(spec: MPIJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # the default is 64 MB
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.hugepages is not None:
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages"}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    if spec.command is None:  # the engines' connection file holds the controller's key: a Secret, owner-only
        volumes.append({"name": "engine", "secret": {"secretName": spec.engine_secret, "defaultMode": 0o400,
                                                     "items": [{"key": ENGINE_FILE, "path": ENGINE_FILE}]}})
        mounts.append({"name": "engine", "mountPath": ENGINE_DIR, "readOnly": True})
    return volumes, mounts


def _worker(spec: MPIJobSpec) -> dict[str, Any]:
    volumes, mounts = _worker_volumes(spec)
    container = {
        "name": "worker", "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
        "command": list(WORKER_SSHD), "env": _env_list(rank_env(spec)),
        "resources": _worker_resources(spec), "volumeMounts": mounts,
    }
    return {"replicas": spec.workers, "restartPolicy": "Never",
            "template": {"metadata": {"labels": _labels(spec, "worker")},
                         "spec": {"containers": [container], "volumes": volumes,
                                  "enableServiceLinks": False, "automountServiceAccountToken": False}}}


def build_manifest(spec: MPIJobSpec) -> dict[str, Any]:
    """The ``kubeflow.org/v2beta1`` MPIJob for ``spec``: a launcher and ``spec.workers`` GPU workers."""
    return { "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": {
            "slotsPerWorker": spec.gpus_per_node,
            "mpiImplementation": spec.mpi_implementation,
            "runPolicy": {"cleanPodPolicy": "Running"},
            "mpiReplicaSpecs": {"Launcher": _launcher(spec), "Worker": _worker(spec)},
        },
    }


class _Dumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (the launcher's script) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml(manifest: dict[str, Any]) -> str:
    """``manifest`` as YAML for ``kubectl apply -f``, headed by how to create the Secret its engines read."""
    name = manifest["metadata"]["name"]
    namespace = manifest["metadata"].get("namespace", "default")
    header = f"# taco_notebook MPIJob {name}, for kubectl apply -f\n"
    worker = manifest["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    secrets = [v["secret"]["secretName"] for v in worker.get("volumes", []) if "secret" in v]
    for secret in secrets:  # the engines' key stays out of the manifest: say how to provide it
        header += (f"# once the Secret its engines read the controller's connection file from exists:\n"
                   f"#   kubectl -n {namespace} create secret generic {secret} \\\n"
                   f"#     --from-file={ENGINE_FILE}=<ipython profile dir>/security/{ENGINE_FILE}\n")
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
