"""A router's public edge (HTTP app + gRPC front) over a scripted backend, running on its own
event loop in a background thread, so tests can talk to it with plain blocking clients
(urllib, the sync gRPC client) and one server lives through a whole table of bad inputs."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

from aiohttp import web

from engine.tokenizer import Tokenizer
from router.auth import ApiKeys
from router.grpc_server import GrpcFront
from router.http_server import make_app
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.node_pool import NodePool
from router.service import RouterService

GREEDY = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}


class EdgeServer:
    def __init__(self, model_dir, backend, *, api_keys=(), info: ModelInfo | None = None,
                 tokenizer=None, reflection_on: bool = False, public_tls=None,
                 **app_options):
        self.backend = backend
        self.info = info or ModelInfo.from_folder(model_dir, name="tiny")
        self.tokenizer = tokenizer or Tokenizer(model_dir)
        self.keys = ApiKeys(api_keys)
        self.reflection_on = reflection_on
        self.public_tls = public_tls           # router/public_tls.py PublicTls, or None
        self.app_options = app_options
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.http_url = self.grpc_address = ""

    async def _start(self) -> None:
        service = RouterService(self.info, self.tokenizer, self.backend,
                                RouterMetrics(NodePool()))
        app = make_app(service, api_keys=self.keys, **self.app_options)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        tls = self.public_tls
        site = web.TCPSite(self._runner, "127.0.0.1", 0,
                           ssl_context=tls.ssl_context() if tls is not None else None)
        await site.start()
        scheme = "https" if tls is not None else "http"
        self.http_url = f"{scheme}://127.0.0.1:{self._runner.addresses[0][1]}"
        self._grpc = GrpcFront(service, "127.0.0.1:0", api_keys=self.keys,
                               reflection_on=self.reflection_on, public_tls=tls,
                               limiter=self.app_options.get("limiter"))
        await self._grpc.start()
        self.grpc_address = f"127.0.0.1:{self._grpc.port}"

    async def _stop(self) -> None:
        await self._grpc.stop(None)
        await self._runner.cleanup()

    def __enter__(self) -> EdgeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()

    def http(self, method: str, path: str, body: object = None,
             headers: dict | None = None, timeout: float = 60) -> tuple[int, dict, dict]:
        """(status, JSON body, headers); `body` bytes/str go as they are, others as JSON."""
        if body is None:
            data = None
        elif isinstance(body, bytes):
            data = body
        elif isinstance(body, str):
            data = body.encode("utf-8", "surrogatepass")
        else:
            data = json.dumps(body).encode()
        req = urllib.request.Request(self.http_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null"), dict(resp.headers)
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null"), dict(err.headers)

    def greedy_text(self, headers: dict | None = None) -> str:
        status, body, _ = self.http("POST", "/v1/completions", GREEDY, headers)
        assert status == 200, body
        return body["choices"][0]["text"]
