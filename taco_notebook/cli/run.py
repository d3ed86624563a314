"""``taco-notebook run NOTEBOOK``: execute a notebook headless and print its outputs.

``run`` is the README's main job: it runs ``examples/01-quickstart.ipynb`` on a local cluster in a real kernel,
shows each cell's progress and text output, and exits non-zero, naming the cell, if one fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "command", "run_notebook"]


def _text_of(output: Any) -> str:
    if output.output_type == "stream":
        return str(output.text)
    if output.output_type in ("execute_result", "display_data"):
        return str(output.get("data", {}).get("text/plain", ""))
    if output.output_type == "error":
        return f"{output.ename}: {output.evalue}"
    return ""


def run_notebook(path: Path, timeout: float, save: Path | None = None) -> int:
    """Execute every cell of ``path`` in a fresh kernel; returns a process exit code."""
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="taco-kernel-") as private:  # 0700: the kernel's sockets and key
        return _execute(notebook, path, timeout, save, Path(private))


def _execute(notebook: Any, path: Path, timeout: float, save: Path | None, private: Path) -> int:
    """Run the cells in a kernel that talks over IPC sockets in ``private``: none of its channels listens on TCP,
    so nothing on the network can reach it (and ipykernel has no plain-text-over-TCP warning to print)."""
    import nbformat
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    manager = AsyncKernelManager(kernel_name="python3", transport="ipc",
                                 connection_file=str(private / "kernel.json"))
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", km=manager,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    status = 0
    began = time.monotonic()
    with client.setup_kernel(cleanup_kc=True):  # a manager handed in is not shut down unless asked
        for number, cell in enumerate(code_cells, 1):
            index = notebook.cells.index(cell)
            first_line = cell.source.splitlines()[0] if cell.source else ""
            print(f"--- cell {number}/{len(code_cells)}: {first_line}", flush=True)
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as exc:
                print(str(exc).strip().splitlines()[-1], file=sys.stderr)
                print(f"FAILED at cell {number} of {path}", file=sys.stderr)
                status = 1
                break
            finally:
                for output in cell.outputs:
                    text = _text_of(output).rstrip()
                    if text:
                        print(text, flush=True)
    if status == 0:
        print(f"--- {path}: {len(code_cells)} cells ran in {time.monotonic() - began:.1f} s", flush=True)
    if save is not None:
        nbformat.write(notebook, save)
    return status


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``run NOTEBOOK [--timeout S] [--save FILE]``."""
    parser = subparsers.add_parser("run", help="execute a notebook headless in a fresh kernel and print its outputs")
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--save", type=Path, default=None, help="write the executed notebook here")
    parser.set_defaults(run_command=lambda args: command(args, parser))
    return parser


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the parsed ``run`` command; a missing notebook is a usage mistake (exit 2)."""
    if not args.notebook.is_file():
        parser.error(f"no notebook at {args.notebook}")
    return run_notebook(args.notebook, args.timeout, args.save)
