"""Capacity measured, admission by it, and the deadline order of the scheduler (issue 59).

The fast half: `voice.service.capacity.Capacity` on a given CPU clock, `Admission` with it, and a stage
worker's order among jobs whose listeners run out of audio at different moments. The live half
(`slow`): the real service with the real models, refusing the session past its capacity within
100 ms on every websocket front, /healthz's headroom dropping while a session talks, and the
HAProxy agent's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from voice.service.capacity import Capacity
from voice.config import Config, LimitsConfig
from voice.service.limits import Admission, LimitError
from voice.service.scheduler import Due, Scheduler


class Clock:
    """A wall clock and a CPU clock that the test advances: `run(wall_s, busy_cores)`."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def run(self, wall_s: float, busy_cores: float) -> None:
        self.wall += wall_s
        self.cpu += wall_s * busy_cores


def measured(limits: LimitsConfig, cores: int = 2) -> tuple[Capacity, Clock]:
    clock = Clock()
    return Capacity(limits, cores, cpu=lambda: clock.cpu, clock=lambda: clock.wall), clock


def _run_python(code: str, **env: str) -> str:
    ours = ("OPENBLAS_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
    base = {k: v for k, v in os.environ.items() if k not in ours}
    return subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_the_service_s_native_thread_pools_do_not_spin_beside_the_lm():
    """numpy's OpenBLAS starts no thread of its own in the service (its second thread spun on a core
    after every mel spectrogram: 12% of one talker's CPU, measured as load), ggml's libgomp spins
    briefly, and a wait policy the user set is theirs."""
    threads = "import os; {first}import numpy; numpy.ones((256, 256)) @ numpy.ones((256, 256)); " \
              "print(len(os.listdir('/proc/self/task')))"
    ours = int(_run_python(threads.format(first="import voice; ")))
    two = int(_run_python(threads.format(first=""), OPENBLAS_NUM_THREADS="2"))
    assert ours == 1 and two > ours
    spin = "import os, voice; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert _run_python(spin) == "10000"
    assert _run_python(spin, OMP_WAIT_POLICY="PASSIVE") == "None"


def test_the_load_and_a_sessions_cost_come_from_the_cpu_time_used():
    capacity, clock = measured(LimitsConfig(max_load=0.9, session_cores=0.2))
    assert capacity.admits(0) and capacity.sessions_max() == 9  # 1.8 usable cores / the 0.2 guessed
    for _ in range(30):  # one session keeps 1.2 cores busy for 30 s
        clock.run(1.0, 1.2)
        capacity.sample(1)
    assert capacity.load == pytest.approx(1.2, abs=0.05)
    assert capacity.session_cores == pytest.approx(1.2, abs=0.05) and capacity.measured
    assert capacity.sessions_max() == 1 and not capacity.admits(1)
    assert capacity.headroom(1) == pytest.approx(1 - 1.2 / 1.8, abs=0.03)


def test_a_lull_does_not_invite_a_crowd():
    """The cost of a session falls slowly: ten seconds of silence still count a talker as a talker."""
    capacity, clock = measured(LimitsConfig(max_load=0.9, session_cores=0.2))
    for _ in range(20):
        clock.run(1.0, 0.9)
        capacity.sample(1)
    for _ in range(10):
        clock.run(1.0, 0.05)
        capacity.sample(1)
    assert capacity.load < 0.2
    assert capacity.session_cores > 0.6 and capacity.sessions_max() <= 2


def test_a_load_past_what_the_cores_give_refuses_whatever_the_estimate():
    capacity, clock = measured(LimitsConfig(max_load=0.5, session_cores=0.01))
    for _ in range(10):
        clock.run(1.0, 2.0)
        capacity.sample(0)  # work with no session counted (a session closing, a long prompt): no cost learnt
    assert capacity.sessions_max() == 100 and not capacity.admits(1)
    assert capacity.admits(0)  # an instance that admits nobody serves nobody


def test_admission_refuses_past_capacity_with_a_retry_hint():
    limits = LimitsConfig(max_load=0.9, session_cores=1.0, retry_after_s=7)
    capacity, _ = measured(limits)
    admission = Admission(limits, capacity=capacity)
    first = admission.acquire("a")
    assert admission.full() is None or admission.total == 1
    with pytest.raises(LimitError) as refused:
        admission.acquire("b")
    assert (refused.value.code, refused.value.close_code, refused.value.retry_after_s) == \
        ("too_many_sessions", 1013, 7)
    first.release()
    admission.acquire("b").release()
    off = Admission(LimitsConfig(max_load=0.0, session_cores=100.0), capacity=measured(limits)[0])
    off.capacity.max_load = 0.0
    tickets = [off.acquire(str(i)) for i in range(5)]  # max_load 0: by max_sessions only
    assert len(tickets) == 5


def test_the_phrase_about_to_run_dry_is_synthesised_first():
    """Among urgent jobs, the earliest deadline goes first: a listener already in silence (a final
    transcript, a first phrase), then the reply whose queued audio runs out soonest. Before, the
    oldest urgent job went first whatever its listener had left to hear."""
    worker = Scheduler().worker("tts")
    started, order = threading.Event(), []
    gate = threading.Event()

    def block() -> None:
        started.set()
        gate.wait(5)
    worker.submit(block)
    assert started.wait(5)
    now = time.monotonic()
    jobs = [worker.submit(order.append, "plenty left", urgent=Due(lambda: now + 0.9, 1.0)),
            worker.submit(order.append, "about to run dry", urgent=Due(lambda: now + 0.1, 1.0)),
            worker.submit(order.append, "not urgent", urgent=Due(lambda: math.inf, 1.0)),
            worker.submit(order.append, "first phrase", urgent=Due(lambda: -math.inf, 1.0)),
            worker.submit(order.append, "final transcript")]
    gate.set()
    for job in jobs:
        job.result(5)
    assert order == ["first phrase", "final transcript", "about to run dry", "plenty left", "not urgent"]


def _step(used_s: float, runs_out: Callable[[], float], since: float) -> SimpleNamespace:
    """A reply in the engine's round (`engine.serving.scheduler.Scheduler.this_round`): a one-row
    step, far from its end, with `used_s` of model time so far."""
    return SimpleNamespace(runs_out=runs_out, warm=False, used_s=used_s, ready_since=since, rows_left=lambda: 10_000,
                           forward=SimpleNamespace(clean=[1], draft=[]))


def test_the_reply_whose_audio_runs_out_first_gets_the_next_forward():
    """The engine's round goes by when each listener's audio runs out (the voice service's deadline,
    on a fake clock here): the reply that runs out first gets the next forward (one row a forward
    here, `max_batch` 1), however much model time its longer reply has had; a newcomer whose user
    waits in silence (-inf) before both. Before, both were WAITED alike and the least served went
    first: the reply about to run dry sat out behind one with a second more of audio queued."""
    from engine.serving.cost import PrefillCost
    from engine.serving.scheduler import Scheduler as Rounds
    from voice.service.scheduler import LM_HORIZON_S
    now = [1000.0]
    rounds = Rounds(cast("Any", None), PrefillCost(), cast("Any", None), cast("Any", None), cast("Any", None),
                    max_batch=1)
    rounds.clock, rounds.horizon_s = lambda: now[0], LM_HORIZON_S
    ends = {"long": now[0] + 0.5, "short": now[0] + 1.5}
    long, short = (_step(used, lambda name=name: ends[name], now[0]) for name, used in (("long", 3.0), ("short", 0.5)))
    assert rounds.this_round([short, long]) == [long, short]
    newcomer = _step(0.0, lambda: -math.inf, now[0])
    assert rounds.this_round([short, long, newcomer]) == [newcomer, long, short]
    now[0] += 0.4
    ends["long"] = now[0] + 1.6  # its next phrase went on the wire: now the short reply's runs out first
    assert rounds.this_round([long, short]) == [short, long]
    ends["long"], long.ready_since = now[0] + LM_HORIZON_S + 1.0, now[0]  # audio to spare: it sits out
    assert rounds.this_round([long, short]) == [short]  # ... while another's runs low
    now[0] += rounds.max_defer_s + 0.01  # ... for at most max_defer_s
    assert rounds.this_round([long, short]) == [short, long]


def test_a_step_whose_audio_runs_out_goes_ahead_of_a_prompt_chunk_in_a_forward_of_its_own():
    """A newcomer's prompt chunk of 20 tokens at 20 ms a token takes 0.4 s: a reply with 0.5 s of audio
    left, in that forward, would get its next token when its listener has heard nothing for a while, so
    its step goes first, alone; one with 1.5 s left can wait for the chunk and shares its forward. No
    chunk, or a token's cost not measured yet: one forward, as before."""
    from engine.serving.cost import PrefillCost
    from engine.serving.scheduler import HURRY_S
    from engine.serving.scheduler import Scheduler as Rounds
    now = [1000.0]
    cost = PrefillCost(token_s=0.02)
    rounds = Rounds(cast("Any", None), cost, cast("Any", None), cast("Any", None), cast("Any", None), max_batch=8)
    rounds.clock = lambda: now[0]
    newcomer = _step(0.0, lambda: -math.inf, now[0])
    newcomer.forward = SimpleNamespace(clean=list(range(20)), draft=[])
    running_out = _step(1.0, lambda: now[0] + 0.5, now[0])
    to_spare = _step(1.0, lambda: now[0] + 0.4 + HURRY_S + 0.6, now[0])
    assert rounds.batches([newcomer, running_out, to_spare]) == [[running_out], [newcomer, to_spare]]
    assert rounds.batches([running_out, to_spare]) == [[running_out, to_spare]]
    cost.token_s = None
    assert rounds.batches([newcomer, running_out, to_spare]) == [[newcomer, running_out, to_spare]]


def test_a_warm_runs_only_where_no_reader_runs_out_while_it_is_read():
    """A warm (reading a conversation ahead; nobody waits for it) sits out, however long, while someone
    waits (outside the engine, or for a first piece) or a playing reply's audio would run out before the
    warm's rows are read (at a token's cost lately) and `HURRY_S` more: each of its chunks, due after
    `max_defer_s`, took 0.35-0.74 s on two busy cores and silenced the replies playing beside it. Where
    every reader has that much audio it runs, beside their steps: sitting out while any reply was being
    read, it never ran beside three talkers, and their next turns read their conversations on the
    critical path. A token's cost not measured yet: only beside no reader."""
    from engine.serving.cost import PrefillCost
    from engine.serving.scheduler import HURRY_S
    from engine.serving.scheduler import Scheduler as Rounds
    from voice.service.scheduler import LM_HORIZON_S
    now = [1000.0]
    cost = PrefillCost(token_s=0.02)
    rounds = Rounds(cast("Any", None), cost, cast("Any", None), cast("Any", None), cast("Any", None), max_batch=8)
    rounds.clock, rounds.horizon_s = lambda: now[0], LM_HORIZON_S
    warm = _step(0.0, lambda: math.inf, now[0])
    warm.warm, warm.forward = True, SimpleNamespace(clean=list(range(16)), draft=[])  # 0.32 s to read
    left = [0.32 + HURRY_S - 0.05]
    playing = _step(1.0, lambda: now[0] + left[0], now[0])
    now[0] += 10 * rounds.max_defer_s
    assert rounds.this_round([warm, playing]) == [playing]
    left[0] = 0.32 + HURRY_S + 0.05  # still within the horizon: its reply is being read, with audio to spare
    assert rounds.this_round([warm, playing]) == [playing, warm]
    assert rounds.batches([playing, warm]) == [[playing, warm]]
    newcomer = _step(0.0, lambda: -math.inf, now[0])
    assert rounds.this_round([warm, playing, newcomer]) == [newcomer, playing]
    rounds.someone_waits = lambda: True
    assert rounds.this_round([warm]) == []
    rounds.someone_waits = lambda: False
    assert rounds.this_round([warm]) == [warm]
    cost.token_s = None
    assert rounds.this_round([warm, playing]) == [playing]
    assert rounds.this_round([warm]) == [warm]


# --- the real service -------------------------------------------------------------------------

def test_the_turns_a_sliding_history_keeps_are_read_aside_and_the_turn_after_reads_one(real_instance):
    """When the history's window slides the prompt's start changes: the turn after read the whole
    kept conversation again (~90 tokens; seconds on two cores busy with three talkers). The turns
    it keeps are read aside as they end (`Chat.prepare(aside=True)`), and the conversation copies
    them from there (`CachePool.share`): it reads only the newest turn and the question."""
    import os

    from fakes import REAL_REPLY_TOKENS
    from voice.conversation.history import History
    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    lm = real_instance(config).lm
    engine, chat = lm.engine, lm.chat()
    history = History(config.lm.system_prompt, turns=3)
    said = [("What is the capital of France?", "Paris is the capital of France."),
            ("And of Spain?", "Madrid is the capital of Spain."),
            ("How far apart are they?", "About a thousand kilometres by road."),
            ("Which is bigger?", "Madrid has more people than Paris proper.")]

    async def the_turn_after_the_slide() -> tuple[Any, list[dict], list[dict]]:
        for question, answer in said[:3]:
            history.add(question, answer)
        await chat.prepare(history.messages(""))  # what the turns' read-ahead leaves in the conversation
        kept = history.kept()
        await chat.prepare(kept, aside=True)
        history.add(*said[3])  # the window slides: the prompt starts with turns 3 and 4
        prompt = history.messages("Thanks, bye.")
        async for piece in engine.stream(prompt, conversation=chat.conversation, max_new_tokens=1):
            return piece, kept, prompt
        raise AssertionError("no reply")

    try:
        piece, kept, prompt = asyncio.run(the_turn_after_the_slide())
    finally:
        chat.close()
    assert [m["content"] for m in kept[1:]] == list(said[2]) and prompt[1]["content"] == said[2][0]
    read_aside = len(os.path.commonprefix([engine.prompt_ids(kept), engine.prompt_ids(prompt)]))
    system = len(engine.open_prompt_ids(prompt[:1]))
    assert read_aside > system + 15  # turn 3, beyond the system prompt every conversation shares
    assert piece.prefilled_tokens == piece.prompt_tokens - read_aside


@contextlib.contextmanager
def _serving_with_capacity(real_instance, limits: dict, agent_port: int = 0):
    """The real service whose Instance admits by a Capacity of `limits` (real_instance has none):
    (port, instance). The shared scheduler is given back as it was (its partials not held back by
    this test's load)."""
    from fakes import REAL_REPLY_TOKENS
    from liveserver import serving
    from voice.service.server import build_app
    from voice.service.instance import Instance

    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    config.server.agent_port = agent_port
    for key, value in limits.items():
        setattr(config.limits, key, value)
    base = real_instance(config)
    load_high = base.scheduler.load_high
    instance = Instance(config, base.whisper, base.synthesizer, base.lm, base.scheduler, Capacity(config.limits))
    try:
        with serving(build_app(config, instance)) as port:
            yield port, instance
    finally:
        base.scheduler.load_high = load_high


@pytest.mark.slow
def test_past_capacity_every_websocket_front_is_refused_within_100_ms(real_instance):
    import websockets
    from websockets.exceptions import InvalidStatus

    from fakes import Client
    with _serving_with_capacity(real_instance, {"session_cores": 64.0, "retry_after_s": 3}) as (port, instance):
        async def scenario() -> dict[str, tuple[float, int, dict, str]]:
            first = await Client.open(f"ws://127.0.0.1:{port}/ws")
            refusals = {}
            for path in ("/ws", "/v1/realtime", "/twilio"):
                start = time.perf_counter()
                with pytest.raises(InvalidStatus) as refused:
                    await websockets.connect(f"ws://127.0.0.1:{port}{path}", open_timeout=5)
                response = refused.value.response
                refusals[path] = ((time.perf_counter() - start) * 1000, response.status_code,
                                  json.loads(response.body or b"{}"), response.headers.get("retry-after"))
            await first.ws.close()
            return refusals
        refusals = asyncio.run(scenario())
    for path, (ms, status, body, retry_after) in refusals.items():
        assert (status, body["error"]["code"], body["error"]["retry_after_s"], retry_after) == \
            (503, "too_many_sessions", 3, "3"), (path, body)
        assert ms < 100, (path, ms)
    assert instance.metrics.refused.labels("capacity")._value.get() == 3
    print("\nrefused in " + ", ".join(f"{path} {ms:.1f} ms" for path, (ms, *_) in refusals.items()))


@pytest.mark.slow
def test_healthz_headroom_drops_while_a_session_talks_and_the_agent_says_so(real_instance):
    import urllib.request

    from cluster import free_port
    from fakes import Client, speech
    agent_port = free_port()

    def healthz(port: int) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return json.loads(r.read())

    def agent() -> str:
        with socket.create_connection(("127.0.0.1", agent_port), timeout=5) as s:
            return s.makefile().readline().strip()

    with _serving_with_capacity(real_instance, {"session_cores": 0.6}, agent_port) as (port, instance):
        time.sleep(2.5)  # the idle load settles (models loaded before; the sampler runs each second)
        idle = healthz(port)
        idle_agent = agent()

        async def scenario() -> tuple[dict, list[float]]:
            c = await Client.open(f"ws://127.0.0.1:{port}/ws")
            c.listen(speed=1.0)
            c.say(speech("001.wav"))
            loads = []
            deadline = time.monotonic() + 60
            while not any(isinstance(m, dict) and m.get("type") == "reply_done" for m in c.log):
                assert time.monotonic() < deadline
                loads.append((await asyncio.to_thread(healthz, port))["capacity"]["load_cores"])
                await asyncio.sleep(0.5)
            talking = await asyncio.to_thread(healthz, port)
            await c.ws.close()
            return talking, loads
        talking, loads = asyncio.run(scenario())
    assert idle["headroom"] > 0.8 and idle["capacity"]["admitting"], idle
    assert idle_agent.startswith("ready ") and int(idle_agent[6:-1]) > 80, idle_agent
    assert max(loads) > idle["capacity"]["load_cores"] + 0.3, (idle, loads)  # the session's work, measured
    assert talking["sessions"] == 1 and talking["headroom"] < idle["headroom"] - 0.2, (idle, talking)


def test_the_default_clock_is_this_process_threads_demand():
    capacity = Capacity(LimitsConfig(max_load=0.9, session_cores=0.6))
    end = time.monotonic() + 0.8
    while time.monotonic() < end:  # one thread busy
        sum(i * i for i in range(10_000))
    capacity.sample(0)
    assert capacity.load > 0.1 and capacity.report(0)["admitting"]
