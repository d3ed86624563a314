"""``%taco_cluster manifest --k8s``: a Kubeflow MPIJob whose ranks are engines of the notebook's controller.

The options are their own parser (``%taco_cluster manifest --help``), so that ``start``'s options stay apart;
:mod:`taco_notebook.cluster.launch.mpijob` builds and checks the manifest, and its ``MPIJobSpecError`` (naming the
option and the fix) becomes a ``UsageError`` here, before anything is written.
"""

from __future__ import annotations

import os
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .args import usage, wants_help

__all__ = ["MANIFEST_KINDS", "manifest_command", "manifest_text", "run_manifest", "write_private_text"]

MANIFEST_KINDS = ("--k8s",)  # the manifests %taco_cluster can write


@magic_arguments()
@argument("--k8s", action="store_true", help="a Kubernetes MPIJob (kubeflow.org/v2beta1, the MPI Operator)")
@argument("-n", "-np", dest="np", default=None, metavar="N", help="ranks in all (one per GPU)")
@argument("--gpus-per-node", dest="gpus_per_node", default="8", metavar="G",
          help="GPUs (and ranks, slotsPerWorker) per worker pod (default 8)")
@argument("--image", default=None, metavar="IMAGE", help="the workers' and launcher's image")
@argument("--image-pull-policy", dest="image_pull_policy", default="IfNotPresent", metavar="POLICY",
          help="Always, IfNotPresent (default) or Never")
@argument("--hugepages", default=None, metavar="SIZE:COUNT",
          help="huge pages per worker, e.g. 1Gi:50 (mounted at /dev/hugepages)")
@argument("--name", default="taco", metavar="NAME", help="the MPIJob's name (default taco)")
@argument("--namespace", default="default", metavar="NS", help="its namespace (default 'default')")
@argument("--controller-address", dest="controller_address", default=None, metavar="HOST",
          help="where the pods reach the notebook's ipyparallel controller (required)")
@argument("--controller-port", dest="controller_port", default=None, metavar="PORT",
          help="the controller's registration port (required)")
@argument("-o", "--output", dest="output", default=None, metavar="FILE",
          help="write the YAML to FILE (private to you) instead of printing it")
def manifest_command(line: str) -> None:
    """Print or write a manifest that runs a cluster's engines elsewhere.

    Example: ``%taco_cluster manifest --k8s -np 16 --gpus-per-node 8 --hugepages 1Gi:50
    --controller-address 10.0.0.5 --controller-port 45123 -o taco.yaml``.
    """


def _integer(value: str | None, option: str) -> int | None:
    """``value`` as an int (its range is the manifest's to judge), or a UsageError naming ``option``."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{option} must be an integer, got {value!r}") from None


def manifest_text(args: Any) -> str:
    """The YAML for parsed ``args``; bad options (0 GPUs, -np not a multiple of them, …) are UsageErrors."""
    from ..cluster.launch.mpijob import MPIJobSpec, MPIJobSpecError, build_manifest, to_yaml

    if not args.k8s:
        raise UsageError(f"%taco_cluster manifest needs the kind of manifest: {', '.join(MANIFEST_KINDS)} "
                         "(a Kubernetes MPIJob), e.g. %taco_cluster manifest --k8s -np 16 --gpus-per-node 8 …")
    if args.np is None:
        raise UsageError("%taco_cluster manifest --k8s needs -np N, the ranks in all (one per GPU)")
    fields: dict[str, Any] = {
        "np": _integer(args.np, "-np"), "gpus_per_node": _integer(args.gpus_per_node, "--gpus-per-node"),
        "controller_address": args.controller_address,
        "controller_port": _integer(args.controller_port, "--controller-port"),
        "image_pull_policy": args.image_pull_policy, "hugepages": args.hugepages, "name": args.name,
        "namespace": args.namespace,
    }
    if args.image is not None:
        fields["image"] = args.image
    try:
        return to_yaml(build_manifest(MPIJobSpec(**fields)))
    except MPIJobSpecError as exc:
        raise UsageError(str(exc)) from None


def write_private_text(path: str, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only (0600 also when the file existed), not through a
    symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)


def run_manifest(line: str) -> None:
    """``%taco_cluster manifest …`` (``line`` without the word ``manifest``): print or write the YAML."""
    if wants_help(line):
        print(usage(manifest_command, "%taco_cluster manifest"))
        return
    args = parse_argstring(manifest_command, line)
    text = manifest_text(args)
    if args.output is None:
        print(text, end="" if text.endswith("\n") else "\n")
        return
    path = os.path.abspath(os.path.expanduser(args.output))
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"-o {args.output}: the folder {os.path.dirname(path)} does not exist; create it or "
                         "write the manifest elsewhere")
    try:
        write_private_text(path, text)
    except OSError as exc:
        raise UsageError(f"-o {args.output}: cannot write it ({exc.strerror}); choose another file") from None
    print(f"MPIJob {args.name!r} written to {path} (mode 0600): kubectl apply -f {path}")
