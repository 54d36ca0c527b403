"""One ASGI app: /ws (native protocol), /v1/realtime (OpenAI's Realtime API), /twilio (Twilio Media Streams),
/token, /healthz, /metrics, the web page at /.

With `[sip] port` set, the SIP/RTP endpoint runs alongside, started and stopped with the app; so
does the Wyoming server for Home Assistant with `[wyoming] port` (voice/transports/wyoming.py).
The app also owns the call records (`voice.service.records`), authentication (`voice.service.auth`) and the
graceful shutdown: `VoiceServer` (what `voice serve` runs) stops admitting sessions, lets
turns in flight finish for up to `limits.shutdown_grace_s`, then ends every session with
`shutting_down` (websocket close 1001, SIP BYE) before uvicorn closes the sockets. It keeps
listening meanwhile, so that a load balancer sees the drain: /healthz answers 503, and a new
websocket is refused with HTTP 503 before the upgrade, which a balancer retries on another
instance (docs/SCALING.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from engine.common.deadlines import guarded_http
from voice.service.auth import Auth, AuthError, check_exposure, install_redaction, is_loopback
from voice.service.capacity import SAMPLE_S, Capacity
from voice.config import Config
from voice.service.limits import LimitError
from voice.service.records import Records, RecordsError
from voice.service.instance import Instance
from voice.pipeline.tools import webhook_secrets
from voice.transports import native, twilio

if TYPE_CHECKING:
    from voice.pipeline.lm import RemoteLM

log = logging.getLogger("voice.server")
# uvicorn's websocket protocol on the `websockets` library's sans-I/O core: its legacy one ("websockets")
# answered 500 to an upgrade with a non-ASCII header byte (it re-encodes the headers as latin-1).
WEBSOCKETS = "websockets-sansio"
WEB_DIR = Path(__file__).resolve().parents[2] / "web"


class VoiceApp:
    """The app's handlers and what they share: the config, authentication, the instance (its models and
    shared state, None until loaded at startup) and the shutdown's progress. `app` is the ASGI app."""

    def __init__(self, config: Config, instance: Instance | None = None, auth: Auth | None = None):
        """`instance` may be given (tests share loaded models); otherwise they load at startup.
        `auth` defaults to `[auth]` with its secrets read from the environment now."""
        self.config, self.instance = config, instance
        self.auth = auth if auth is not None else Auth.from_config(config.auth)
        install_redaction(self.auth)  # no secret of this server in any log line (engine.common.redact)
        self.draining = self.drained = False
        self.probe: asyncio.Task | None = None  # the remote LM's health probe
        routes = [WebSocketRoute("/ws", self.ws_native), WebSocketRoute("/twilio", self.ws_twilio),
                  WebSocketRoute("/v1/realtime", self.ws_realtime), Route("/healthz", self.healthz),
                  Route("/metrics", self.metrics), Route("/token", self.token, methods=["POST"])]
        web = Path(config.server.web_dir) if config.server.web_dir else WEB_DIR
        if web.is_dir():
            routes.append(Mount("/", StaticFiles(directory=web, html=True)))
        self.app = Starlette(routes=routes, lifespan=self.lifespan)
        self.app.state.voice = self

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop admitting sessions, let turns in flight finish, then end every session."""
        instance = self.instance
        self.draining = True
        if instance is None or self.drained:
            return
        self.drained = True
        instance.admission.draining = True
        grace = self.config.limits.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        busy = [s for s in instance.live if s.busy]
        log.info("shutting down: %d sessions open, %d with a turn in flight (waiting up to %.0f s)",
                 len(instance.live), len(busy), grace)
        while any(s.busy for s in instance.live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for session in list(instance.live):
            session.terminate("shutting_down", "the server is shutting down", 1001)
        until = time.monotonic() + 5.0  # the transports send the error and close
        while instance.live and time.monotonic() < until:
            await asyncio.sleep(0.05)
        if instance.live:
            log.warning("shutting down with %d sessions still open", len(instance.live))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Start: the models, the call records, the LM probe, SIP and Wyoming. Stop: drain, then
        give them back in reverse."""
        config = self.config
        if self.instance is None:
            self.instance = Instance.load(config)
        instance = self.instance
        records_owned = False
        if config.records.database and instance.records is None:
            try:
                instance.records = Records(config.records.database, config.records.queue, config.records.timeout_s,
                                         instance.metrics)
            except (OSError, RecordsError) as err:
                log.error("call records: %s (set records.path or records.url, or both \"\" for no records)", err)
                raise
            records_owned = True
        tasks: list[asyncio.Task] = []
        agent: asyncio.Server | None = None
        if instance.capacity is not None:
            instance.capacity.reset()
            tasks.append(asyncio.create_task(_measure(instance.capacity, instance.live)))
            if config.server.agent_port:
                agent = await asyncio.start_server(self.agent, config.server.host, config.server.agent_port)
        if config.lm.backend == "openai" and config.lm.probe_interval_s:
            self.probe = asyncio.create_task(_probe(cast("RemoteLM", instance.lm), config.lm.probe_interval_s))
        sip = None
        if config.sip.port:
            from voice.transports.sip import SipEndpoint
            sip = SipEndpoint(instance, config.sip)
            await sip.start()
        app.state.sip = sip
        wyoming = None
        if config.wyoming.port:
            from voice.transports.wyoming import WyomingServer
            wyoming = WyomingServer(instance, config.wyoming)
            await wyoming.start()
        app.state.wyoming = wyoming
        log.info("voice service ready on http://%s:%d (%s)", config.server.host, config.server.port,
                 self.auth.describe())
        try:
            yield
        finally:
            await self.drain(0.0)  # if VoiceServer didn't already (then this does nothing)
            for task in tasks:
                task.cancel()
            if agent is not None:
                agent.close()
            if self.probe is not None:
                self.probe.cancel()
            if sip is not None:
                await sip.stop()
            if wyoming is not None:
                await wyoming.stop()
            await instance.tools.aclose()
            if records_owned and instance.records is not None:
                await asyncio.to_thread(instance.records.close)
                instance.records = None

    def loaded(self) -> Instance:
        assert self.instance is not None  # loaded at startup, before any connection is served
        return self.instance

    async def refused_before_upgrade(self, ws: WebSocket) -> bool:
        """While draining or at capacity, answer a new websocket HTTP 503 with Retry-After before the
        upgrade, at once: a load balancer retries it on another instance (an error after the upgrade
        it could not), and a client knows when to try again."""
        if self.draining:
            refusal: LimitError | None = LimitError("shutting_down", "the server is shutting down; try again in a "
                                                    "moment", 1001, 1)
        else:
            refusal = self.loaded().admission.full()
        if refusal is None or "websocket.http.response" not in ws.scope.get("extensions", {}):
            return False  # (a server without the denial extension: admission refuses it after the upgrade)
        if not self.draining:
            self.loaded().admission.refusal()  # counted and logged
        body = {"error": {"code": refusal.code, "message": refusal.message, "retry_after_s": refusal.retry_after_s}}
        await ws.send_denial_response(JSONResponse(body, status_code=503,
                                                   headers={"retry-after": str(refusal.retry_after_s)}))
        return True

    async def ws_native(self, ws: WebSocket) -> None:
        if not await self.refused_before_upgrade(ws):
            await native.handle(ws, self.loaded(), self.auth)

    async def ws_realtime(self, ws: WebSocket) -> None:
        if not await self.refused_before_upgrade(ws):  # at once: before the first import of the front
            from voice.transports import realtime
            await realtime.handle(ws, self.loaded(), self.auth)

    async def ws_twilio(self, ws: WebSocket) -> None:
        if not await self.refused_before_upgrade(ws):
            await twilio.handle(ws, self.loaded(), self.auth)

    async def healthz(self, request: Request) -> JSONResponse:
        config, instance = self.config, self.instance
        body: dict[str, Any] = {"status": "ok", "lm": config.lm.backend, "model": config.lm.model,
                                "mode": instance.lm.mode if instance is not None else config.lm.mode,
                                "auth": self.auth.enabled}
        if request.client is not None and is_loopback(request.client.host) and \
                "x-forwarded-for" not in request.headers:  # not through a proxy on this machine
            body["pid"] = os.getpid()  # for `voice soak` on the same machine
        if instance is None:
            body["status"] = "loading"
            return JSONResponse(body)
        body["sessions"] = len(instance.live)
        if instance.capacity is not None:  # measured: what a load balancer (or its agent-check) goes by
            body["capacity"] = instance.capacity.report(len(instance.live))
            body["headroom"] = body["capacity"]["headroom"]
        decoding = instance.lm.describe()  # the in-process LM: what runs and why
        if decoding is not None:
            body["decoding"] = decoding
        lm_health = instance.lm.health()  # an endpoint elsewhere: is it up
        if lm_health is not None:
            body["lm_health"] = lm_health
            if not lm_health["ok"]:
                body["status"] = "degraded"
        faults = instance.recent_faults()
        if faults:
            body["faults"] = faults  # stage -> "error" | "timeout" within the last minute
            body["status"] = "degraded"
        if instance.records is not None:
            body["records"] = instance.records.health()  # its state now: a writer that reconnected is healthy
            if not body["records"]["ok"]:
                body["status"] = "degraded"
        if self.draining:
            body["status"] = "shutting_down"
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    async def agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HAProxy's agent-check (`[server] agent_port`): one line, the share of new sessions this
        instance should get ("ready 40%": its headroom as the server's weight) or "drain" (full:
        no new sessions, those open carry on). Draining for shutdown is /healthz's 503."""
        instance = self.loaded()
        line = "drain\n"
        if instance.admission.full() is None:
            headroom = instance.capacity.headroom(len(instance.live)) if instance.capacity is not None else 1.0
            line = f"ready {max(1, round(headroom * 100))}%\n"
        try:
            writer.write(line.encode())
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    def bearer(self, request: Request) -> str:
        if not self.auth.enabled:
            return "anonymous"
        return self.auth.principal(request.headers, {})  # keys only: no tokens in URLs here

    async def metrics(self, request: Request) -> Response:
        try:
            self.bearer(request)
        except AuthError as err:
            return _auth_error(err)
        body = generate_latest(self.instance.metrics.registry) if self.instance else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def token(self, request: Request) -> JSONResponse:
        """POST with `Authorization: Bearer KEY` -> a short-lived token for `/ws?token=...` (browsers)."""
        auth = self.auth
        if not auth.enabled:
            return JSONResponse({"error": {"code": "auth_off", "message": "authentication is not enabled on "
                                           "this server: connect without a token"}}, status_code=404)
        if "authorization" not in request.headers:
            return _auth_error(AuthError("unauthorized", "send 'Authorization: Bearer <API key>'"))
        try:
            principal = self.bearer(request)
        except AuthError as err:
            return _auth_error(err)
        value, expiry = auth.issue_token(principal)
        return JSONResponse({"token": value, "expires_at": expiry, "expires_in": int(auth.token_ttl_s)},
                            headers={"cache-control": "no-store"})


def build_app(config: Config, instance: Instance | None = None, auth: Auth | None = None) -> Starlette:
    """The ASGI app (VoiceApp's); `app.state.voice` is the VoiceApp."""
    return VoiceApp(config, instance, auth).app


def _auth_error(err: AuthError) -> JSONResponse:
    return JSONResponse({"error": {"code": err.code, "message": err.message}}, status_code=err.status,
                        headers={"www-authenticate": "Bearer"} if err.status == 401 else None)


async def _measure(capacity: Capacity, live: set) -> None:
    """The capacity's load, sampled while the app runs (admission and /healthz read it)."""
    while True:
        capacity.sample(len(live))
        await asyncio.sleep(SAMPLE_S)


async def _probe(lm: RemoteLM, interval: float) -> None:
    while True:
        await lm.probe()
        await asyncio.sleep(interval)


class VoiceServer(uvicorn.Server):
    """uvicorn, but on shutdown the app drains first (turns finish, sessions get a goodbye), still
    listening: /healthz says 503 `shutting_down` meanwhile, so a load balancer takes this instance
    out instead of finding its port closed."""

    def __init__(self, config: uvicorn.Config, app: Starlette):
        super().__init__(config)
        self.voice_app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await self.voice_app.state.voice.drain()
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.exception("draining failed")
        await super().shutdown(sockets)


def serve(config: Config) -> None:
    auth = Auth.from_config(config.auth)
    check_exposure(config, auth)
    webhook_secrets(config.tools)  # a secret HTTP cannot carry stops start-up here, before any model loads
    install_redaction(auth)
    if not auth.enabled:
        log.warning("authentication is off (no API keys): only clients on this machine can connect")
    elif auth.secret_is_random:
        log.info("browser tokens are signed with a random per-process secret (set $%s to share one)",
                 config.auth.token_secret_env)
    app = build_app(config, auth=auth)
    uv = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level="info", ws=WEBSOCKETS,
                        ws_max_size=max(config.session.max_frame_bytes * 2, 1 << 20),
                        timeout_graceful_shutdown=5, http=guarded_http())  # head and body read deadlines
    install_redaction(auth)  # again: uvicorn.Config has just replaced its loggers' handlers
    VoiceServer(uv, app).run()
