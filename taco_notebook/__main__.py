"""Command line: ``python -m taco_notebook run NOTEBOOK`` executes a notebook headless and prints its outputs;
``python -m taco_notebook launch -np 4 train.py ARGS`` runs a script on every rank (:mod:`.launch`).

``run`` is the README's main job: it runs ``examples/01-quickstart.ipynb`` on a local cluster in a real kernel,
shows each cell's progress and text output, and exits non-zero, naming the cell, if one fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_notebook"]


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
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    status = 0
    began = time.monotonic()
    with client.setup_kernel():
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taco_notebook", description="taco_notebook from a shell: run "
                                     "a notebook headless, or a script on every rank")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute a notebook headless in a fresh kernel and print its outputs")
    run.add_argument("notebook", type=Path)
    run.add_argument("--timeout", type=float, default=600, help="seconds allowed per cell (default 600)")
    run.add_argument("--save", type=Path, default=None, help="write the executed notebook here")
    from .launch import build_parser, launch

    launcher = build_parser(sub.add_parser(
        "launch", help="run a Python script on every rank of a cluster (horovodrun's shape): launch -np 4 "
                       "train.py ARGS"))
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch(args, launcher)
    if not args.notebook.is_file():
        parser.error(f"no notebook at {args.notebook}")
    return run_notebook(args.notebook, args.timeout, args.save)


if __name__ == "__main__":
    sys.exit(main())
