"""Thin REST handlers over :class:`~taco_notebook.server.manager.ClusterManager`, authenticated and authorized
as jupyter_server's own are, and the server extension app (:class:`TacoServerExtension`) that routes them and
stops the manager's clusters at shutdown.

``GET  clusters``             → ClusterList             ``GET    clusters/{id}`` → ClusterModel
``POST clusters`` {size,name?} → 202 ClusterModel        ``PATCH  clusters/{id}`` {size} → 202 ClusterModel
``GET  version``   → {"version", "max_ranks"}           ``DELETE clusters/{id}`` → 202 ClusterModel
``GET  clusters/{id}/stacks`` → the hang autopsy: every rank's stacks and collective, grouped, suspects named
``POST clusters/{id}/peek`` {expr, ranks?, timeout?} → the expression's value on each rank, while a cell runs

Every verb is ``async`` and awaits the manager's ``*_async`` twins, which run in worker threads: reading and
pruning the registry, killing a stale cluster's processes or starting one never blocks the event loop.
Every verb is ``@tornado.web.authenticated`` then ``@authorized`` on :data:`AUTH_RESOURCE`, with the action
jupyter_server derives from the HTTP method as it does for kernels (GET "read"; POST, PATCH, DELETE "write"),
so a deployment's ``ServerApp.authorizer_class`` decides who may start, stop and scale clusters (403 otherwise).
A peek runs code on the ranks: it also needs ``execute`` on ``kernels``, what running code in a kernel needs.

Errors are ``{"message", "reason"}`` (APIHandler.write_error) with 400, 404 or 409 from the manager's errors,
and 413 for a body over :data:`~taco_notebook.server.requests.MAX_BODY_BYTES`: the handlers stream the body
(``stream_request_body``), so a declared ``Content-Length`` over the cap is refused before the body is read, and
a chunked body is cut off by tornado as soon as it passes the cap.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.extension.handler import ExtensionHandlerMixin
from jupyter_server.utils import url_path_join

from . import API_PATH, MANAGER_SETTING
from .manager import ClusterManager
from .requests import MAX_BODY_BYTES, ManagerError, TooLarge

__all__ = ["AUTH_RESOURCE", "VersionHandler", "ClustersHandler", "ClusterHandler", "StacksHandler", "PeekHandler",
           "routes", "TacoServerExtension"]

AUTH_RESOURCE = "taco_notebook.clusters"  # the resource an Authorizer is asked about, as "kernels" for kernels

T = TypeVar("T")


def _http_error(exc: ManagerError) -> tornado.web.HTTPError:
    """The HTTP error a manager's refusal stands for, its message kept (a 4xx stays a 4xx that says why)."""
    message = str(exc)
    return tornado.web.HTTPError(exc.status, message, reason=message.splitlines()[0][:200])


@tornado.web.stream_request_body
class _ManagerHandler(ExtensionHandlerMixin, APIHandler):
    """Base of the handlers: the manager, its errors as HTTP errors, and a body capped at MAX_BODY_BYTES."""

    auth_resource = AUTH_RESOURCE
    _body: bytearray

    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()  # jupyter_server's: authentication state, XSRF
        self._body = bytearray()
        declared = self.request.headers.get("Content-Length", "0")
        if self.current_user and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            refusal = TooLarge(f"request body of {declared} bytes is over the limit of {MAX_BODY_BYTES} bytes")
            raise _http_error(refusal)
        self.request.connection.set_max_body_size(MAX_BODY_BYTES)  # type: ignore[union-attr]

    def data_received(self, chunk: bytes) -> None:
        self._body += chunk

    @property
    def body(self) -> bytes:
        return bytes(self._body)

    @property
    def manager(self) -> ClusterManager:
        manager: ClusterManager = self.settings[MANAGER_SETTING]
        return manager

    async def call(self, method: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await method(*args)`` (a manager's ``*_async`` twin), its refusal turned into the HTTP error it
        stands for; any other exception is a bug and stays tornado's 500."""
        try:
            return await method(*args)
        except ManagerError as exc:
            raise _http_error(exc) from None

    def reply(self, model: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(model))


class VersionHandler(_ManagerHandler):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.reply(await self.call(self.manager.version_async))


class ClustersHandler(_ManagerHandler):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        self.reply(await self.call(self.manager.list_async))

    @tornado.web.authenticated
    @authorized
    async def post(self) -> None:
        self.reply(await self.call(self.manager.start_async, self.body), 202)


class ClusterHandler(_ManagerHandler):
    @tornado.web.authenticated
    @authorized
    async def get(self, cluster_id: str) -> None:
        self.reply(await self.call(self.manager.get_async, cluster_id))

    @tornado.web.authenticated
    @authorized
    async def delete(self, cluster_id: str) -> None:
        self.reply(await self.call(self.manager.stop_async, cluster_id), 202)

    @tornado.web.authenticated
    @authorized
    async def patch(self, cluster_id: str) -> None:
        self.reply(await self.call(self.manager.scale_async, cluster_id, self.body), 202)


class StacksHandler(_ManagerHandler):
    @tornado.web.authenticated
    @authorized
    async def get(self, cluster_id: str) -> None:
        self.reply(await self.call(self.manager.stacks_async, cluster_id))


class PeekHandler(_ManagerHandler):
    @tornado.web.authenticated
    @authorized
    @authorized("execute", resource="kernels")
    async def post(self, cluster_id: str) -> None:
        self.reply(await self.call(self.manager.peek_async, cluster_id, self.body))


def routes() -> list[tuple[str, type[_ManagerHandler]]]:
    """The API's routes, relative to the server's base URL (the extension app prepends it and passes each
    handler the extension's name, as :class:`ExtensionHandlerMixin` expects)."""
    return [
        (url_path_join(API_PATH, "version"), VersionHandler),
        (url_path_join(API_PATH, "clusters"), ClustersHandler),
        (url_path_join(API_PATH, "clusters", "([^/]+)"), ClusterHandler),
        (url_path_join(API_PATH, "clusters", "([^/]+)", "stacks"), StacksHandler),
        (url_path_join(API_PATH, "clusters", "([^/]+)", "peek"), PeekHandler),
    ]


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

    def initialize_settings(self) -> None:
        """Make the manager; it reaches the handlers through the web app's settings (:data:`MANAGER_SETTING`)."""
        self.manager = ClusterManager()
        self.settings[MANAGER_SETTING] = self.manager

    def initialize_handlers(self) -> None:
        self.handlers.extend(routes())
        assert self.serverapp is not None  # linked by jupyter_server before it initializes the handlers
        self.log.info("taco_notebook server extension: REST API at %s%s/", self.serverapp.base_url, API_PATH)

    async def stop_extension(self) -> None:
        """Stop every cluster this server started (each stop takes a second or two: off the event loop)."""
        if self.manager is not None:
            stopped = await self.manager.shutdown_async()
            if stopped:  # ipyparallel's own stop lines are not in the server's log (cluster/launch/ipplog.py)
                self.log.info("taco_notebook: stopped the clusters this server started: %s", ", ".join(stopped))
