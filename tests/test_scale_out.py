"""Several voice instances behind a real load balancer (issue 32, item 3; docs/SCALING.md).

The topology of docs/SCALING.md with every part real (tests/cluster.py): one PostgreSQL
(tests/postgres.py) for the call records, the LM on one `engine serve` (the packaged `small`,
SmolLM2-135M, which leaves the 2 cores to speech), two `voice serve` processes (real VAD, Whisper,
Piper; `[lm] backend = "openai"`; the API keys and the token secret shared) behind HAProxy
running configs/haproxy.cfg as shipped. Clients are /ws sessions through the balancer playing
tests/speech, each with its own API key, so the call records say whose turn a row is; HAProxy's
`X-Voice-Instance` header says which instance took a session.

1. spread: four sessions, two on each instance (each one's /healthz counts them), a turn each;
   /v1/realtime and /twilio upgrade through the balancer too, and a token POSTed to it is taken by
   either instance.
2. SIGTERM drains: voice2 gets SIGTERM while the user of its session is speaking. Its /healthz says
   503 `shutting_down` at once; a new session the balancer sends it (it has fewer) is answered 503
   and redispatched to voice1; the health check takes voice2 out on that 503 while it drains; the
   turn finishes (`reply_done`, not interrupted), then `shutting_down` and close 1001, and the
   process exits.
3. voice2, started again on its port, is back in rotation.
4. kill -9 mid-turn: every session speaks at once and voice1 is killed while one of its replies is
   streaming. voice1's clients see their connection close; voice2's sessions finish their turns
   and stay open; a new session goes to voice2 and is served.
5. the records: every turn a client got `reply_done` for is in PostgreSQL exactly once, with the
   reply and heard text the client was told; the only other rows are of turns voice1 was killed in.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
import urllib.request
from collections import Counter

import pytest
import websockets

from cluster import HAProxy, engine_serve, free_port, haproxy_binary, http_get, voice_config, voice_serve
from fakes import Client, speech

pytestmark = [pytest.mark.slow, pytest.mark.live, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TURN_TIMEOUT_S = 120.0  # a turn on 2 shared cores with five sessions speaking at once
NAMES = [f"c{i}" for i in range(1, 10)] + ["realtime", "twilio"]


def instance(ws) -> str:
    """The instance HAProxy sent a websocket to: the X-Voice-Instance header configs/haproxy.cfg adds."""
    assert ws.response is not None
    return ws.response.headers["x-voice-instance"]


class Caller:
    """One /ws session through the balancer under its own API key: which instance took it, and the
    `reply_done` of each of its turns."""

    def __init__(self, name: str, client: Client):
        self.name, self.client = name, client
        self.instance = instance(client.ws)
        self.turn = 0
        self.done: dict[int, dict] = {}

    def speak(self, clip: str) -> int:
        """Start the next turn with `clip`; its number."""
        self.turn += 1
        self.client.say(speech(clip))
        return self.turn

    async def reply_done(self, turn: int) -> dict:
        done = await self.client.wait(lambda m: m["type"] == "reply_done" and m["turn"] == turn, TURN_TIMEOUT_S)
        self.done[turn] = done
        return done

    async def exchange(self, clip: str) -> dict:
        return await self.reply_done(self.speak(clip))

    async def replying(self) -> dict:
        """The first `reply` event of the current turn (the LM's first block is out, the turn goes on)."""
        return await self.client.wait(lambda m: m["type"] == "reply" and m["turn"] == self.turn, TURN_TIMEOUT_S)

    @property
    def open(self) -> bool:
        return self.client.close is None


def test_two_instances_behind_haproxy(tmp_path, postgres_url, require_system):
    require_system(haproxy_binary(), "HAProxy is not installed (apt-get install haproxy)")
    keys = {name: secrets.token_hex(16) for name in NAMES}
    env = {k: v for k, v in os.environ.items() if k != "TWILIO_AUTH_TOKEN"}
    env |= {"VOICE_API_KEYS": ",".join(f"{name}:{key}" for name, key in keys.items()),
            "VOICE_TOKEN_SECRET": secrets.token_hex(16)}  # shared: a token one issues, the other takes

    def auth(name: str) -> dict:
        return {"Authorization": f"Bearer {keys[name]}"}

    engine_port, ports, lb_port = free_port(), (free_port(), free_port()), free_port()
    engine = engine_serve(engine_port, tmp_path, model="small", max_new_tokens=16)
    config = voice_config(tmp_path / "voice.toml", {
        # AR: engine serve decodes it whatever its kernels (on llama.cpp's, which `quantize = auto` takes
        # without AVX-512, it refuses diffusion, and every reply would be the apology)
        "lm": {"backend": "openai", "url": f"http://127.0.0.1:{engine_port}/v1", "model": "small", "mode": "ar",
               "max_new_tokens": 16},
        "records": {"url": postgres_url},
        # admission by the counts: five processes share these 2 cores, and what is tested here is the
        # topology (test_a_full_instance_gets_no_new_callers tests admission by capacity)
        "limits": {"shutdown_grace_s": 60.0, "max_load": 0.0}})
    voices = {"voice1": voice_serve(ports[0], config, tmp_path, env),
              "voice2": voice_serve(ports[1], config, tmp_path, env)}
    lb = None
    callers: list[Caller] = []
    try:
        engine.wait_ready()
        for voice in voices.values():
            voice.wait_ready()
        lb = HAProxy(lb_port, ports, tmp_path)
        lb.wait_ready(30)

        def direct(name: str) -> str:
            return f"http://127.0.0.1:{ports[0 if name == 'voice1' else 1]}"

        async def call(name: str, **connect) -> Caller:
            client = await Client.open(lb.ws + "/ws", additional_headers=auth(name), **connect)
            client.listen(speed=1.0)  # in real time, as people speak
            callers.append(Caller(name, client))
            return callers[-1]

        def sessions_on(name: str) -> int:
            return int(lb.servers()[name]["scur"])

        async def scenario() -> dict:
            # 1. spread
            first = [await call(name) for name in ("c1", "c2", "c3", "c4")]
            assert sorted(c.instance for c in first) == ["voice1", "voice1", "voice2", "voice2"]
            for name in voices:
                assert http_get(direct(name) + "/healthz")[1]["sessions"] == 2, name
            await asyncio.gather(*(c.exchange(clip) for c, clip in zip(first, ("001.wav", "002.wav", "003.wav",
                                                                                "004.wav"))))
            async with websockets.connect(lb.ws + "/v1/realtime", additional_headers=auth("realtime")) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
            async with websockets.connect(lb.ws + "/twilio", additional_headers=auth("twilio")) as ws:
                assert instance(ws) in voices
            request = urllib.request.Request(lb.http + "/token", method="POST", headers=auth("c9"))
            token = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=10).read()))
            by_token = [await Client.open(f"{lb.ws}/ws?token={token['token']}") for _ in voices]  # one on each
            assert {instance(client.ws) for client in by_token} == set(voices)
            for client in by_token:
                await client.shut()

            # 2. SIGTERM drains voice2
            on1 = [c for c in first if c.instance == "voice1"]
            busy, idle = [c for c in first if c.instance == "voice2"]
            await idle.client.shut()
            while sessions_on("voice2") != 1:  # fewer than voice1: the balancer's next pick
                await asyncio.sleep(0.05)
            turn = busy.speak("005.wav")  # 3.5 s of speech: the drain lasts longer than two health checks
            await busy.client.wait(lambda m: m["type"] == "speech_started" and m["turn"] == turn, 30)
            t0 = time.monotonic()
            voices["voice2"].terminate()
            while (health := await asyncio.to_thread(http_get, direct("voice2") + "/healthz"))[0] != 503:
                assert health[0] == 200 and time.monotonic() - t0 < 2, health  # still listening
            assert health[1]["status"] == "shutting_down", health
            redispatched = int(lb.servers()["voice2"]["wredis"])
            late = await call("c5")
            assert late.instance == "voice1"
            assert int(lb.servers()["voice2"]["wredis"]) == redispatched + 1, "the balancer did not redispatch"
            taken_out = await asyncio.to_thread(lb.wait_status, "voice2", "DOWN")
            assert (taken_out["check_status"], taken_out["check_code"]) == ("L7STS", "503"), taken_out
            assert voices["voice2"].proc.poll() is None, "voice2 exited before the balancer saw it drain"
            taken_out_s = time.monotonic() - t0
            assert (await busy.reply_done(turn))["interrupted"] is False
            assert await busy.client.closed(60) == (1001, "shutting_down")
            # uvicorn raises the signal again once it has shut down: killed by SIGTERM, but only now
            assert await asyncio.to_thread(voices["voice2"].wait, 60) in (0, -signal.SIGTERM)
            drained_s = time.monotonic() - t0
            assert all(c.open for c in on1)

            # 3. voice2 back
            voices["voice2"].restart()
            await asyncio.to_thread(voices["voice2"].wait_ready)
            await asyncio.to_thread(lb.wait_status, "voice2", "UP")

            # 4. kill -9 voice1 mid-turn
            fresh = [await call(name) for name in ("c6", "c7")]
            assert [c.instance for c in fresh] == ["voice2", "voice2"]
            victims, survivors = on1 + [late], fresh
            clips = ["goforward.wav", "forever.wav", "001.wav", "002.wav", "003.wav"]
            turns = {c.name: c.speak(clip) for c, clip in zip(victims + survivors, clips)}
            watching = [asyncio.create_task(c.replying()) for c in victims]
            await asyncio.wait(watching, return_when=asyncio.FIRST_COMPLETED)
            voices["voice1"].kill()
            for task in watching:
                task.cancel()
            for c in victims:
                assert (await c.client.closed(30))[0] == 1006, c.name  # no close frame: the instance died
                c.done |= {e["turn"]: e for e in c.client.events("reply_done")}
            in_flight = {c.name: turns[c.name] for c in victims if turns[c.name] not in c.done}
            assert in_flight, "voice1 was killed after every turn had been reported done"
            for c in survivors:
                assert (await c.reply_done(turns[c.name]))["interrupted"] is False, c.name
            assert all(c.open for c in survivors)
            after = await call("c8")
            assert after.instance == "voice2"
            assert (await after.exchange("004.wav"))["interrupted"] is False
            await asyncio.to_thread(lb.wait_status, "voice1", "DOWN")
            for c in callers:
                if c.open:
                    await c.client.shut()
            return {"drained_s": drained_s, "taken_out_s": taken_out_s, "in_flight": in_flight}

        result = asyncio.run(scenario())
        rows = turn_rows(postgres_url)
    finally:
        for child in [lb, *voices.values(), engine]:
            if child is not None:
                child.close()

    # 5. the records
    reported = {(c.name, turn): done for c in callers for turn, done in c.done.items()}
    counts = Counter((r["principal"], r["turn"]) for r in rows)
    assert max(counts.values()) == 1, [key for key, n in counts.items() if n > 1]
    by_key = {(r["principal"], r["turn"]): r for r in rows}
    for key, done in reported.items():
        assert key in by_key, f"{key} was reported done but is not in PostgreSQL"
        assert (by_key[key]["reply"], by_key[key]["heard"]) == (done["text"], done["heard"]), key
    unreported = set(by_key) - set(reported)
    assert unreported <= set(result["in_flight"].items()), unreported
    print(f"\nrecords: {len(reported)} turns reported done, {len(rows)} rows in PostgreSQL "
          f"({len(unreported)} committed by voice1 before it was killed, unreported); "
          f"SIGTERM -> out of the balancer in {result['taken_out_s']:.1f} s, drained and exited in "
          f"{result['drained_s']:.1f} s")


def turn_rows(url: str) -> list[dict]:
    import psycopg
    from psycopg.rows import dict_row
    with psycopg.connect(url, row_factory=dict_row) as conn:
        return conn.execute("SELECT s.principal, t.turn, t.status, t.reply, t.heard FROM turns t "
                            "JOIN sessions s ON s.uid = t.session_uid").fetchall()



def test_a_full_instance_gets_no_new_callers(tmp_path, require_system):
    """Issue 59: voice1 has room for one session (its measured capacity, `limits.session_cores`
    set so that one fills it), voice2 for all (`max_load = 0`: whatever these shared cores give).
    Two callers through HAProxy take one instance each; voice1 is then full: its agent says
    "drain" (HAProxy shows it "DRAIN (agent)") and /healthz says it admits nobody, so the third
    and fourth callers go to voice2. All four are answered; when voice1's caller leaves, it takes
    calls again."""
    require_system(haproxy_binary(), "HAProxy is not installed (apt-get install haproxy)")
    engine_port, ports, agents, lb_port = free_port(), (free_port(), free_port()), (free_port(), free_port()), \
        free_port()
    engine = engine_serve(engine_port, tmp_path, model="small", max_new_tokens=16)
    lm = {"backend": "openai", "url": f"http://127.0.0.1:{engine_port}/v1", "model": "small", "mode": "ar",
          "max_new_tokens": 16}
    voices = {"voice1": voice_serve(ports[0], voice_config(tmp_path / "voice1.toml", {
                  "server": {"agent_port": agents[0]}, "lm": lm, "records": {"path": ""},
                  "limits": {"session_cores": 64.0}}), tmp_path),
              "voice2": voice_serve(ports[1], voice_config(tmp_path / "voice2.toml", {
                  "server": {"agent_port": agents[1]}, "lm": lm, "records": {"path": ""},
                  "limits": {"max_load": 0.0}}), tmp_path)}  # by the counts only: room for all four here
    lb = None
    try:
        engine.wait_ready()
        for voice in voices.values():
            voice.wait_ready()
        lb = HAProxy(lb_port, ports, tmp_path, agents)
        lb.wait_ready(30)
        assert lb.wait_status("voice1", "UP") and lb.wait_status("voice2", "UP")

        async def call(name: str) -> Caller:
            client = await Client.open(lb.ws + "/ws")
            client.listen(speed=1.0)
            return Caller(name, client)

        async def scenario() -> tuple[list[Caller], dict, dict]:
            first = [await call("c1"), await call("c2")]
            assert sorted(c.instance for c in first) == ["voice1", "voice2"], [
                f"{name}: " + " ".join(f"{k}={row[k]}" for k in ("status", "weight", "scur", "agent_desc", "wredis"))
                for name, row in lb.servers().items()]
            full = http_get(f"http://127.0.0.1:{ports[0]}/healthz")[1]
            drained = await asyncio.to_thread(lb.wait_status, "voice1", "DRAIN (agent)", 5.0)
            later = [await call("c3"), await call("c4")]
            assert [c.instance for c in later] == ["voice2", "voice2"]
            callers = first + later
            await asyncio.gather(*(c.exchange(clip) for c, clip in zip(callers, ("001.wav", "002.wav", "003.wav",
                                                                                 "004.wav"))))
            await next(c for c in first if c.instance == "voice1").client.shut()
            back = await asyncio.to_thread(lb.wait_status, "voice1", "UP", 10.0)
            return callers, full, drained | {"back": back["status"]}
        callers, full, drained = asyncio.run(scenario())
    finally:
        for child in [lb, *voices.values(), engine]:
            if child is not None:
                child.close()
    assert full["capacity"]["admitting"] is False and full["headroom"] == 0.0, full
    assert all(c.done[1]["text"] and not c.done[1].get("interrupted") for c in callers), [c.done for c in callers]
    print(f"\nvoice1 full at {full['sessions']} session: HAProxy {drained['status']}, callers 3 and 4 on voice2; "
          f"back {drained['back']} once its caller left")
