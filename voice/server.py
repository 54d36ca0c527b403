"""One ASGI app: /ws (native protocol), /twilio (Twilio Media Streams), /token, /healthz, /metrics, the web page at /.

With `[sip] port` set, the SIP/RTP endpoint runs alongside, started and stopped with the app; so
does the Wyoming server for Home Assistant with `[wyoming] port` (voice/transports/wyoming.py).
The app also owns the call records (`voice.records`), authentication (`voice.auth`) and the
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from voice.auth import Auth, AuthError, check_exposure, install_redaction, is_loopback
from voice.config import Config
from voice.records import Records, RecordsError
from voice.stages import Stages
from voice.tools import webhook_secrets
from voice.transports import native, twilio

log = logging.getLogger("voice.server")
WEB_DIR = Path(__file__).resolve().parent.parent / "web"


@dataclass
class _State:
    """What the app's handlers share: the stages (None until loaded at startup), shutdown progress."""

    stages: Stages | None
    draining: bool = False
    drained: bool = False
    probe: asyncio.Task | None = None  # the remote LM's health probe


def build_app(config: Config, stages: Stages | None = None, auth: Auth | None = None) -> Starlette:
    """`stages` may be given (tests share loaded models); otherwise they load at startup.
    `auth` defaults to `[auth]` with its secrets read from the environment now."""
    auth = auth if auth is not None else Auth.from_config(config.auth)
    install_redaction(auth)  # no secret of this server in any log line (engine.common.redact)
    state = _State(stages)

    async def drain(grace_s: float | None = None) -> None:
        """Stop admitting sessions, let turns in flight finish, then end every session."""
        stages = state.stages
        state.draining = True
        if stages is None or state.drained:
            return
        state.drained = True
        stages.admission.draining = True
        grace = config.limits.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        busy = [s for s in stages.live if s.busy]
        log.info("shutting down: %d sessions open, %d with a turn in flight (waiting up to %.0f s)",
                 len(stages.live), len(busy), grace)
        while any(s.busy for s in stages.live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for session in list(stages.live):
            session.terminate("shutting_down", "the server is shutting down", 1001)
        until = time.monotonic() + 5.0  # the transports send the error and close
        while stages.live and time.monotonic() < until:
            await asyncio.sleep(0.05)
        if stages.live:
            log.warning("shutting down with %d sessions still open", len(stages.live))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state.stages is None:
            state.stages = Stages.load(config)
        stages = state.stages
        if config.records.database and stages.records is None:
            try:
                stages.records = Records(config.records.database, config.records.queue, config.records.timeout_s,
                                         stages.metrics)
            except (OSError, RecordsError) as err:
                log.error("call records: %s (set records.path or records.url, or both \"\" for no records)", err)
                raise
            app.state.records_owned = True
        if config.lm.backend == "openai" and config.lm.probe_interval_s:
            state.probe = asyncio.create_task(_probe(stages.lm, config.lm.probe_interval_s))
        sip = None
        if config.sip.port:
            from voice.transports.sip import SipEndpoint
            sip = SipEndpoint(stages, config.sip)
            await sip.start()
        app.state.sip = sip
        wyoming = None
        if config.wyoming.port:
            from voice.transports.wyoming import WyomingServer
            wyoming = WyomingServer(stages, config.wyoming)
            await wyoming.start()
        app.state.wyoming = wyoming
        log.info("voice service ready on http://%s:%d (%s)", config.server.host, config.server.port,
                 auth.describe())
        try:
            yield
        finally:
            await drain(0.0)  # if VoiceServer didn't already (then this does nothing)
            if state.probe is not None:
                state.probe.cancel()
            if sip is not None:
                await sip.stop()
            if wyoming is not None:
                await wyoming.stop()
            await stages.tools.aclose()
            if getattr(app.state, "records_owned", False):
                await asyncio.to_thread(stages.records.close)
                stages.records = None

    def loaded() -> Stages:
        assert state.stages is not None  # loaded at startup, before any connection is served
        return state.stages

    async def refused_while_draining(ws: WebSocket) -> bool:
        """While draining, answer a new websocket HTTP 503 before the upgrade: a load balancer retries
        it on another instance (an error after the upgrade it could not)."""
        if not state.draining or "websocket.http.response" not in ws.scope.get("extensions", {}):
            return False  # (a server without the denial extension: admission refuses it after the upgrade)
        body = {"error": {"code": "shutting_down", "message": "the server is shutting down; try again in a moment"}}
        await ws.send_denial_response(JSONResponse(body, status_code=503, headers={"retry-after": "1"}))
        return True

    async def ws_native(ws: WebSocket):
        if not await refused_while_draining(ws):
            await native.handle(ws, loaded(), auth)

    async def ws_realtime(ws: WebSocket):
        from voice.transports import realtime
        if not await refused_while_draining(ws):
            await realtime.handle(ws, loaded(), auth)

    async def ws_twilio(ws: WebSocket):
        if not await refused_while_draining(ws):
            await twilio.handle(ws, loaded(), auth)

    async def healthz(request: Request):
        stages = state.stages
        body: dict[str, Any] = {"status": "ok", "lm": config.lm.backend, "model": config.lm.model,
                                "mode": stages.lm.mode if stages is not None else config.lm.mode, "auth": auth.enabled}
        if request.client is not None and is_loopback(request.client.host) and \
                "x-forwarded-for" not in request.headers:  # not through a proxy on this machine
            body["pid"] = os.getpid()  # for `voice soak` on the same machine
        if stages is None:
            body["status"] = "loading"
            return JSONResponse(body)
        body["sessions"] = len(stages.live)
        lm_health = getattr(stages.lm, "health", None)
        if lm_health is not None:
            body["lm_health"] = lm_health()
            if not body["lm_health"]["ok"]:
                body["status"] = "degraded"
        faults = stages.recent_faults()
        if faults:
            body["faults"] = faults  # stage -> "error" | "timeout" within the last minute
            body["status"] = "degraded"
        if stages.records is not None:
            body["records"] = {"written": stages.records.written, "failed": stages.records.failed}
            if stages.records.failed:
                body["status"] = "degraded"
        if state.draining:
            body["status"] = "shutting_down"
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    def bearer(request: Request) -> str:
        if not auth.enabled:
            return "anonymous"
        principal = auth.principal(request.headers, {})  # keys only: no tokens in URLs here
        return principal

    async def metrics(request: Request):
        try:
            bearer(request)
        except AuthError as err:
            return _auth_error(err)
        stages = state.stages
        body = generate_latest(stages.metrics.registry) if stages else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def token(request: Request):
        """POST with `Authorization: Bearer KEY` -> a short-lived token for `/ws?token=...` (browsers)."""
        if not auth.enabled:
            return JSONResponse({"error": {"code": "auth_off", "message": "authentication is not enabled on "
                                           "this server: connect without a token"}}, status_code=404)
        if "authorization" not in request.headers:
            return _auth_error(AuthError("unauthorized", "send 'Authorization: Bearer <API key>'"))
        try:
            principal = bearer(request)
        except AuthError as err:
            return _auth_error(err)
        value, expiry = auth.issue_token(principal)
        return JSONResponse({"token": value, "expires_at": expiry, "expires_in": int(auth.token_ttl_s)},
                            headers={"cache-control": "no-store"})

    routes = [WebSocketRoute("/ws", ws_native), WebSocketRoute("/twilio", ws_twilio),
              WebSocketRoute("/v1/realtime", ws_realtime), Route("/healthz", healthz),
              Route("/metrics", metrics), Route("/token", token, methods=["POST"])]
    web = Path(config.server.web_dir) if config.server.web_dir else WEB_DIR
    if web.is_dir():
        routes.append(Mount("/", StaticFiles(directory=web, html=True)))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.drain = drain
    app.state.auth = auth
    app.state.voice = state
    return app


def _auth_error(err: AuthError) -> JSONResponse:
    return JSONResponse({"error": {"code": err.code, "message": err.message}}, status_code=err.status,
                        headers={"www-authenticate": "Bearer"} if err.status == 401 else None)


async def _probe(lm, interval: float) -> None:
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

    async def shutdown(self, sockets=None) -> None:
        try:
            await self.voice_app.state.drain()
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
    uv = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level="info", ws="websockets",
                        ws_max_size=max(config.session.max_frame_bytes * 2, 1 << 20),
                        timeout_graceful_shutdown=5)
    install_redaction(auth)  # again: uvicorn.Config has just replaced its loggers' handlers
    VoiceServer(uv, app).run()
