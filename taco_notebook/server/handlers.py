"""Thin, authenticated REST handlers over :class:`~taco_notebook.server.manager.ClusterManager`, and the server
extension app (:class:`TacoServerExtension`) that routes them and stops the manager's clusters at shutdown.

``GET  clusters``             → ClusterList             ``GET    clusters/{id}`` → ClusterModel
``POST clusters`` {size,name?} → 202 ClusterModel        ``PATCH  clusters/{id}`` {size} → 202 ClusterModel
``GET  version``   → {"version", "max_ranks"}           ``DELETE clusters/{id}`` → 202 ClusterModel

Errors are ``{"message", "reason"}`` (APIHandler.write_error) with 400, 404 or 409 from the manager's errors,
and 413 for a body over :data:`~taco_notebook.server.requests.MAX_BODY_BYTES`: the handlers stream the body
(``stream_request_body``), so a declared ``Content-Length`` over the cap is refused before the body is read, and
a chunked body is cut off by tornado as soon as it passes the cap.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.utils import url_path_join

from . import API_PATH, MANAGER_SETTING
from .manager import ClusterManager
from .requests import MAX_BODY_BYTES, ManagerError, TooLarge

__all__ = ["VersionHandler", "ClustersHandler", "ClusterHandler", "setup_handlers", "TacoServerExtension"]

T = TypeVar("T")


@tornado.web.stream_request_body
class _ManagerHandler(APIHandler):
    """Base of the handlers: the manager, its errors as HTTP errors, and a body capped at MAX_BODY_BYTES."""

    _body: bytearray

    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()  # jupyter_server's: authentication state, XSRF
        self._body = bytearray()
        declared = self.request.headers.get("Content-Length", "0")
        if self.current_user and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            self.call(self._refuse, int(declared))
        self.request.connection.set_max_body_size(MAX_BODY_BYTES)  # type: ignore[union-attr]

    @staticmethod
    def _refuse(size: int) -> None:
        raise TooLarge(f"request body of {size} bytes is over the limit of {MAX_BODY_BYTES} bytes")

    def data_received(self, chunk: bytes) -> None:
        self._body += chunk

    @property
    def body(self) -> bytes:
        return bytes(self._body)

    @property
    def manager(self) -> ClusterManager:
        manager: ClusterManager = self.settings[MANAGER_SETTING]
        return manager

    def call(self, method: Callable[..., T], *args: Any) -> T:
        """``method(*args)``, its refusal turned into the HTTP error it stands for."""
        try:
            return method(*args)
        except ManagerError as exc:
            message = str(exc)
            raise tornado.web.HTTPError(exc.status, message, reason=message.splitlines()[0][:200]) from None

    def reply(self, model: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(model))


class VersionHandler(_ManagerHandler):
    @tornado.web.authenticated
    def get(self) -> None:
        self.reply(self.call(self.manager.version))


class ClustersHandler(_ManagerHandler):
    @tornado.web.authenticated
    def get(self) -> None:
        self.reply(self.call(self.manager.list))

    @tornado.web.authenticated
    def post(self) -> None:
        self.reply(self.call(self.manager.start, self.body), 202)


class ClusterHandler(_ManagerHandler):
    @tornado.web.authenticated
    def get(self, cluster_id: str) -> None:
        self.reply(self.call(self.manager.get, cluster_id))

    @tornado.web.authenticated
    def delete(self, cluster_id: str) -> None:
        self.reply(self.call(self.manager.stop, cluster_id), 202)

    @tornado.web.authenticated
    def patch(self, cluster_id: str) -> None:
        self.reply(self.call(self.manager.scale, cluster_id, self.body), 202)


def setup_handlers(web_app: Any, manager: ClusterManager | None = None) -> ClusterManager:
    """Route ``/taco-notebook/api/…`` to the handlers, over ``manager`` (a new one by default); the caller stops
    it (:class:`TacoServerExtension` does when the server shuts down)."""
    manager = manager or ClusterManager()
    web_app.settings[MANAGER_SETTING] = manager
    base = url_path_join(web_app.settings["base_url"], API_PATH)
    web_app.add_handlers(".*$", [
        (url_path_join(base, "version"), VersionHandler),
        (url_path_join(base, "clusters"), ClustersHandler),
        (url_path_join(base, "clusters", "([^/]+)"), ClusterHandler),
    ])
    return manager


class TacoServerExtension(ExtensionApp):
    """The server extension: adds the handlers, and stops the clusters this server started when it shuts down.

    An :class:`~jupyter_server.extension.application.ExtensionApp` because that is what jupyter_server (2.21 here)
    calls at shutdown: ``ServerApp._cleanup`` → ``cleanup_extensions`` → ``stop_extension`` of each extension
    app. A module-level extension gets no call (there is no ``_unload_jupyter_server_extension``), so stopping
    would be left to atexit, after the server has stopped answering and while its kernels are being killed.
    """

    name = "taco_notebook"
    load_other_extensions = True
    manager: ClusterManager | None = None

    def initialize_handlers(self) -> None:
        assert self.serverapp is not None  # linked by jupyter_server before it initializes the handlers
        self.manager = setup_handlers(self.serverapp.web_app)
        self.log.info("taco_notebook server extension: REST API at %s%s/", self.serverapp.base_url, API_PATH)

    async def stop_extension(self) -> None:
        """Stop every cluster this server started (each stop takes a second or two: off the event loop)."""
        if self.manager is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.manager.shutdown)
