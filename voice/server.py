"""One ASGI app: /ws (native protocol), /twilio (Twilio Media Streams), /healthz, /metrics, the web page at /.

With `[sip] port` set, the SIP/RTP endpoint runs alongside, started and stopped with the app.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from voice.config import Config
from voice.session import Stages
from voice.transports import native, twilio

log = logging.getLogger("voice.server")
WEB_DIR = Path(__file__).resolve().parent.parent / "web"


def build_app(config: Config, stages: Stages | None = None) -> Starlette:
    """`stages` may be given (tests share loaded models); otherwise they load at startup."""
    state = {"stages": stages}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if state["stages"] is None:
            state["stages"] = Stages(config)
        sip = None
        if config.sip.port:
            from voice.transports.sip import SipEndpoint
            sip = SipEndpoint(state["stages"], config.sip)
            await sip.start()
        app.state.sip = sip
        log.info("voice service ready on http://%s:%d", config.server.host, config.server.port)
        try:
            yield
        finally:
            if sip is not None:
                await sip.stop()

    async def ws_native(ws: WebSocket):
        await native.handle(ws, state["stages"])

    async def ws_twilio(ws: WebSocket):
        await twilio.handle(ws, state["stages"])

    async def healthz(request: Request):
        stages = state["stages"]
        return JSONResponse({"status": "ok" if stages else "loading", "lm": config.lm.backend,
                             "model": config.lm.model, "mode": config.lm.mode})

    async def metrics(request: Request):
        stages = state["stages"]
        body = generate_latest(stages.metrics.registry) if stages else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    routes = [WebSocketRoute("/ws", ws_native), WebSocketRoute("/twilio", ws_twilio), Route("/healthz", healthz),
              Route("/metrics", metrics)]
    web = Path(config.server.web_dir) if config.server.web_dir else WEB_DIR
    if web.is_dir():
        routes.append(Mount("/", StaticFiles(directory=web, html=True)))
    return Starlette(routes=routes, lifespan=lifespan)


def serve(config: Config) -> None:
    import uvicorn
    uvicorn.run(build_app(config), host=config.server.host, port=config.server.port, log_level="info",
                ws="websockets", ws_max_size=max(config.session.max_frame_bytes * 2, 1 << 20))
