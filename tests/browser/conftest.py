"""A real-browser harness: a real ``jupyter lab`` server and a headless Debian chromium driven by Playwright.

Fixtures
--------
``lab``   the JupyterLab server (started once per session, see :class:`LabServer`); after each test every kernel
          it started is shut down and every process those kernels started (MPI engines, ipcontroller) must have
          exited, or the test fails.
``page``  a fresh chromium context and page; on teardown it always writes ``test-artifacts/<test>.png`` (and
          ``<test>.console.log`` with the browser console), failed test or not.

Helpers (plain functions, take the ``page``): :func:`open_notebook`, :func:`wait_for_kernel_idle`,
:func:`run_all_cells`, :func:`wait_for_cell_output`, :func:`wait_for_cells_executed`, :func:`cell_output`.

The server is session-scoped because a cold JupyterLab start costs ~5 s on two cores. The lead's autouse
``no_leaked_processes`` (``tests/conftest.py``) fails a test that leaves any process carrying this session's
``TACO_TEST_SESSION`` behind, so the server runs with that variable suffixed (``<mark>/browser-lab``) and a marker
of its own (``TACO_BROWSER_LAB``) that its kernels and their MPI engines inherit; the ``lab`` fixture applies the
same rule to them itself after each test: nothing but the server process may carry the marker. The chromium and
Playwright driver processes are per test and keep the real ``TACO_TEST_SESSION``, so the lead's check covers them.

Chromium is Debian's (``apt-get install -y chromium fonts-liberation``); nothing here downloads a browser.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("TACO_BROWSER_CHROMIUM", "/usr/bin/chromium")  # Debian's; never a downloaded one
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic"]
INSTALL_HINT = "apt-get install -y chromium fonts-liberation"
LAB_MARK_ENV = "TACO_BROWSER_LAB"
STATUS_BAR = "#jp-main-statusbar"


def _python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def marked_processes(mark: str) -> dict[int, str]:
    """Live (non-zombie) processes whose environment carries ``TACO_BROWSER_LAB=mark``: pid -> command line."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(LAB_MARK_ENV) == mark:
                found[proc.pid] = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


@dataclass
class LabServer:
    """A running ``jupyter lab``: ``url`` (no trailing slash), ``token``, ``root_dir`` (notebooks go here)."""

    url: str
    token: str
    root_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    mark: str

    # ---- REST API -------------------------------------------------------------------------------------------
    def api(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        """Call the server's REST API (``path`` like ``/api/kernels``); JSON in, JSON (or None) out."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def kernels(self) -> list[dict[str, Any]]:
        return self.api("GET", "/api/kernels")

    def shutdown_kernels(self) -> None:
        """Shut down every session and kernel (the kernels' atexit stops their taco clusters)."""
        try:
            for session in self.api("GET", "/api/sessions"):
                try:
                    self.api("DELETE", f"/api/sessions/{session['id']}", timeout=30)
                except urllib.error.HTTPError:
                    pass
            for kernel in self.kernels():
                try:
                    self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=30)
                except urllib.error.HTTPError:
                    pass
        except (urllib.error.URLError, OSError):  # server already gone
            pass

    def children_left(self) -> dict[int, str]:
        """Processes the server started (kernels, their MPI clusters, ...) that are still alive."""
        return {pid: cmd for pid, cmd in marked_processes(self.mark).items() if pid != self.proc.pid}

    def wait_children_gone(self, timeout: float) -> dict[int, str]:
        deadline = time.monotonic() + timeout
        while True:
            left = self.children_left()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.25)

    # ---- files ----------------------------------------------------------------------------------------------
    def write_notebook(self, name: str, cells: Sequence[str]) -> Path:
        """Write a notebook of code cells into ``root_dir`` (python3 kernelspec, so Lab starts it unasked)."""
        import nbformat

        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
        path = self.root_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, path)
        return path

    def tree_url(self, name: str, workspace: str | None = None) -> str:
        """``/lab/tree/<name>``; in a fresh workspace of its own when given one (tabs of earlier tests stay shut)."""
        prefix = f"/lab/workspaces/{workspace}" if workspace else "/lab"
        return f"{self.url}{prefix}/tree/{name}?token={self.token}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _write_lab_settings(settings_dir: Path) -> None:
    """User settings: no news / update pop-up over the UI."""
    notification = settings_dir / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True, exist_ok=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


def _start_lab(base: Path) -> LabServer:
    dirs = [base / n for n in ("root", "runtime", "settings", "workspaces", "tmp")]
    root_dir, runtime_dir, settings_dir, workspaces_dir, tmp_dir = dirs
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    _write_lab_settings(settings_dir)
    token = secrets.token_hex(24)
    port = _free_port()
    mark = uuid.uuid4().hex
    env = dict(os.environ)
    env.update({
        "JUPYTER_RUNTIME_DIR": str(runtime_dir),
        "JUPYTERLAB_SETTINGS_DIR": str(settings_dir),
        "JUPYTERLAB_WORKSPACES_DIR": str(workspaces_dir),  # not ~/.jupyter/lab/workspaces
        "TMPDIR": str(tmp_dir),
        LAB_MARK_ENV: mark,
        # Not this session's mark: the server outlives single tests (see the module docstring).
        "TACO_TEST_SESSION": f"{os.environ.get('TACO_TEST_SESSION', '')}/browser-lab",
        "BOKEH_RESOURCES": "inline",  # no CDN here
        "PYTHONUNBUFFERED": "1",
    })  # fmt: skip
    env.pop("JUPYTER_TOKEN", None)
    log_path = base / "lab.log"
    cmd = [
        _python(), "-m", "jupyterlab", "--no-browser", "--allow-root",
        "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
        "--ServerApp.open_browser=False",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=root_dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C at the terminal reaches pytest, whose teardown stops the server
        )  # fmt: skip
    server = LabServer(f"http://127.0.0.1:{port}", token, root_dir, log_path, proc, mark)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if server.api("GET", "/api/status", timeout=2) is not None:
                return server
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            _stop_lab(server)
            raise RuntimeError(f"jupyter lab did not answer /api/status within 90 s:\n{server.log_tail()}")
        time.sleep(0.2)


def _stop_lab(server: LabServer, grace: float = 15.0) -> dict[int, str]:
    """Kernels first (DELETE), then the server (SIGTERM, SIGKILL after ``grace``), then any straggler it started.
    Returns what had to be killed at the end."""
    if server.proc.poll() is None:
        server.shutdown_kernels()
        server.wait_children_gone(30)
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(grace)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
    left = server.wait_children_gone(10)
    _kill_pids(list(left))
    return left


@pytest.fixture(scope="session")
def _browser_available() -> None:
    """Skip (before JupyterLab is started for nothing) where chromium or the playwright package is missing."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: install it with `{INSTALL_HINT}` (never `playwright install`)")
    pytest.importorskip("playwright.sync_api", reason="pip install 'playwright>=1.40' (it needs no browser download)")


@pytest.fixture(scope="session")
def _lab_server(_browser_available: None, tmp_path_factory) -> Iterator[LabServer]:
    server = _start_lab(tmp_path_factory.mktemp("jupyterlab"))
    try:
        yield server
    finally:
        left = _stop_lab(server)
        if left:
            print(f"browser lab fixture killed stragglers at session end: {left}", file=sys.stderr)


@pytest.fixture
def lab(_lab_server: LabServer, request) -> Iterator[LabServer]:
    """The session's JupyterLab server. After the test: every kernel is shut down and every process the server
    started must exit (taco clusters included) within 60 s, otherwise they are killed and the test fails."""
    server = _lab_server
    if server.proc.poll() is not None:
        pytest.fail(f"jupyter lab died (rc {server.proc.returncode}):\n{server.log_tail()}")
    yield server
    server.shutdown_kernels()
    left = server.wait_children_gone(60)
    if left:
        _kill_pids(list(left))
        pytest.fail(f"{request.node.nodeid}: processes started under JupyterLab outlived their kernel: {left}")


# ---- browser ------------------------------------------------------------------------------------------------
def _artifact_name(request) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("_")


@pytest.fixture
def page(_browser_available: None, lab: LabServer, request) -> Iterator[Any]:
    """A fresh headless chromium page. Teardown always saves ``test-artifacts/<test>.png`` first (full page)."""
    from playwright import sync_api

    console: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            pg = context.new_page()
            pg.on("console", lambda m: console.append(f"[{m.type}] {m.text}"))
            pg.on("pageerror", lambda e: console.append(f"[pageerror] {e}"))
            try:
                yield pg
            finally:
                ARTIFACTS.mkdir(exist_ok=True)
                name = _artifact_name(request)
                try:
                    pg.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True, timeout=30_000)
                except Exception as exc:  # the screenshot must not hide the test's own failure
                    console.append(f"[harness] screenshot failed: {exc!r}")
                (ARTIFACTS / f"{name}.console.log").write_text("\n".join(console) + "\n")
                context.close()
        finally:
            browser.close()


# ---- helpers ------------------------------------------------------------------------------------------------
def open_notebook(page: Any, lab: LabServer, name: str, timeout: float = 120.0) -> None:
    """Open ``root_dir/name`` in Lab, in a workspace of its own, and wait until its kernel is idle."""
    workspace = "w" + uuid.uuid4().hex[:12]
    page.goto(lab.tree_url(name, workspace), timeout=timeout * 1000)
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=timeout * 1000)
    wait_for_kernel_idle(page, timeout)


def wait_for_kernel_idle(page: Any, timeout: float = 120.0) -> None:
    """Wait for the status bar's kernel item to read ``... | Idle`` (the toolbar indicator is not reliable)."""
    from playwright.sync_api import expect

    expect(page.locator(STATUS_BAR)).to_contain_text(re.compile(r"\|\s*Idle"), timeout=timeout * 1000)


def run_all_cells(page: Any) -> None:
    """Menu Run → Run All Cells on the active notebook."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


def code_cells(page: Any) -> Any:
    return page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-CodeCell")


def cell_output(page: Any, index: int) -> Any:
    """The output area of the ``index``-th code cell (0-based) of the visible notebook."""
    return code_cells(page).nth(index).locator(".jp-OutputArea")


def wait_for_cell_output(page: Any, index: int, text: str | re.Pattern[str], timeout: float = 60.0) -> None:
    """Wait until the ``index``-th code cell's output contains ``text``."""
    from playwright.sync_api import expect

    expect(cell_output(page, index)).to_contain_text(text, timeout=timeout * 1000)


def wait_for_cells_executed(page: Any, timeout: float = 120.0) -> None:
    """Wait until every code cell shows an execution count (``[3]:``), i.e. none is queued (``[*]``) or unrun."""
    from playwright.sync_api import expect

    prompts = code_cells(page).locator(".jp-InputArea-prompt")
    count = prompts.count()
    for i in range(count):
        expect(prompts.nth(i)).to_have_text(re.compile(r"^\[\d+\]:?$"), timeout=timeout * 1000)
