"""Regression tests for the third adversarial pass (issue 56): one test per defect, each failing
before its fix. `engine serve` is its real app around the stand-in engines of tests/fakes.py.

* work bounds: a documented decode option (`rule threshold, threshold 1.0, first_block_size 1024`)
  held the shared scheduler for minutes; now a request's worst-case work is bounded at parse time.
* numerical and structural guards: tiny temperatures in the verify rule and the draft head, a
  tool call's deeply nested arguments (RecursionError: a 500), `$ref` cycles in a JSON schema.
"""

from __future__ import annotations

import math
import time

import pytest

from fakes import EncodingEngine
from liveserver import serving
from test_adversarial import HELLO, assert_400, post, still_answers

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def engine_port():
    from engine.api.server import build_app
    from engine.decode import DecodeConfig
    with serving(build_app(EncodingEngine(), DecodeConfig(max_new_tokens=8))) as port:
        yield port


# --- work bounds at parse time --------------------------------------------------------------------

@pytest.mark.parametrize("options, param", [
    ({"rule": "threshold", "threshold": 1.0, "first_block_size": 1024, "max_tokens": 1024}, "first_block_size"),
    ({"rule": "threshold", "block_size": 1900, "max_steps": 1900, "max_tokens": 1900}, "block_size"),
    ({"rule": "topk", "topk": 1, "block_size": 512, "max_tokens": 512}, "block_size"),
    ({"block_size": 1000, "max_tokens": 1000}, "block_size"),  # verify: prompt lookup drafts up to 1,000 rows
    ({"rule": "topk", "topk": 1, "block_size": 64, "max_tokens": 2048}, "max_tokens"),  # 131,072 rows at worst
], ids=["threshold_first_block", "block_and_steps", "topk_block", "verify_block", "total_rows"])
def test_a_request_whose_worst_case_work_is_over_the_budget_is_refused_before_it_runs(engine_port, options, param):
    """Mask blocks were bounded by the context alone: one request's 1,024-row blocks, denoised a
    token a step, stalled every other request of `engine serve --model default` (none answered in 30 s)."""
    assert_400(*post(engine_port, {**HELLO, **options}), param)
    still_answers(engine_port)


def test_requests_within_the_work_budget_still_run(engine_port):
    for options in ({"rule": "threshold", "block_size": 32, "max_tokens": 512},
                    {"rule": "topk", "topk": 4, "first_block_size": 8, "block_size": 64, "max_tokens": 1024},
                    {"block_size": 64, "max_tokens": 1000}, {"mode": "ar", "max_tokens": 2000}):
        status, answer = post(engine_port, {**HELLO, **options})
        assert status == 200, (options, answer)


def test_worst_rows_counts_each_rule_at_its_worst():
    from engine.api.requests import Runs, worst_rows
    from engine.decode import DecodeConfig
    runs = Runs(draft_block=None, mask_blocks=True, mask_block=8)
    assert worst_rows(DecodeConfig(mode="ar", max_new_tokens=100), runs) == (0, 100)
    assert worst_rows(DecodeConfig(max_new_tokens=100), runs) == (4, 500)  # prompt lookup's 4 rows + 1
    # threshold: 20 tokens = a first block of 4 (4 steps of 4 rows), then 8 + 8 (8 steps of 8 rows each)
    assert worst_rows(DecodeConfig(rule="threshold", first_block_size=4, max_new_tokens=20), runs) == (8, 16 + 2 * 64)
    # topk 3 on blocks of 8: 3 steps each; max_steps 2 caps that; a tail block of 2 takes one
    assert worst_rows(DecodeConfig(rule="topk", topk=3, max_new_tokens=18), runs) == (8, 2 * 24 + 2)
    assert worst_rows(DecodeConfig(rule="topk", topk=1, max_steps=2, max_new_tokens=16), runs) == (8, 2 * 16)


# --- numerical and structural guards ----------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_a_tiny_temperature_is_the_limit_in_the_verify_rule_and_the_draft_head_too(temperature):
    """`pick()` had the tiny-temperature guard; the verify rule and the draft head's sampling divided
    the logits by the temperature and failed with "probability tensor contains inf/nan" (a 500 from
    `engine serve --model default` for `"temperature": 1e-300`). Now each samples the likeliest token."""
    import torch

    from engine.decode import verify_rule
    from engine.draft import DraftArgs, DraftHead, Proposal
    target = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 1.0, 0.5]])  # the base's logits at each row
    committed = verify_rule(target, Proposal([1], torch.tensor([[0.1, 0.6, 0.2, 0.1]])), temperature,
                            torch.Generator().manual_seed(0))
    assert committed == [1, 0]  # the drafted token agrees with the base's likeliest, then the base's own
    head = DraftHead(DraftArgs(dim=8, vocab_size=4, draft_vocab=3, block=2, n_heads=2, hidden_dim=16),
                     torch.tensor([3, 1, 0]))
    proposal = head._pick(torch.tensor([[0.5, 2.0, 1.0], [3.0, 1.0, 0.0]]), temperature,
                          torch.Generator().manual_seed(0))
    assert proposal.ids == [1, 3] and proposal.confidence == [1.0, 1.0]


def test_deeply_nested_tool_call_arguments_are_a_400_not_a_500(engine_port):
    """`json.loads` of `"[" * 1000 + "]" * 1000` raised RecursionError, which only a ValueError
    handler stood before: HTTP 500 on both models. Now the one bounded wire decoder reads them."""
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "done"}]}
    assert_400(*post(engine_port, body), "messages[1].tool_calls[0].function.arguments")
    still_answers(engine_port)


CYCLES = [{"$ref": "#"},
          {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
          {"definitions": {"a": {"allOf": [{"$ref": "#/definitions/a"}]}}, "type": "object",
           "properties": {"x": {"$ref": "#/definitions/a"}}}]


@pytest.mark.parametrize("schema", CYCLES, ids=["self", "two_defs", "all_of"])
def test_a_json_schema_whose_ref_leads_back_to_itself_is_refused(schema):
    """`{"$ref": "#"}` (or two `$defs` naming each other) compiled, and the reply was 200 `stop` with
    empty, non-JSON content on both models."""
    from engine.api.requests import APIError, parse_request
    from engine.decode import DecodeConfig
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(APIError) as err:
        parse_request({**HELLO, "response_format": fmt}, DecodeConfig(), 2048)
    assert err.value.status == 400 and err.value.param == "response_format.json_schema.schema"
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(APIError) as err:
        parse_request({**HELLO, "tools": tools}, DecodeConfig(), 2048)
    assert err.value.status == 400 and err.value.param == "tools[0].function.parameters"


def test_a_recursive_schema_that_makes_progress_is_still_accepted():
    from engine.api.requests import parse_request
    from engine.decode import DecodeConfig
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    assert parse_request({**HELLO, "response_format": fmt}, DecodeConfig(), 2048)[2].schema == tree


# --- conversations that recover (Realtime) ------------------------------------------------------------

def test_a_refused_message_is_deleted_and_the_next_one_is_answered(tmp_path):
    """"Say hi." completed; one message too long for the LM's context was refused
    (`context_length_exceeded`), and every later "Say hi." too: the refused item stayed in the
    history the LM sees. Now it is removed from it, the client gets `conversation.item.deleted`
    for it, and the next message is answered."""
    import asyncio

    from fakes import LiveServer, fake_instance, make_config
    from test_hostile import StrictLM
    from test_realtime import Talk, connect

    config = make_config(records={"path": str(tmp_path / "records.sqlite3")})
    lm = StrictLM()  # refuses prompts over 1,500 characters, as an engine refuses a context overflow
    with LiveServer(config, fake_instance(config, lm=lm)) as srv:
        async def go():
            async with connect(srv) as conn:
                talk = Talk(conn)
                for n, text in enumerate(["Say hi.", "1" * 1600 + " digits", "Say hi.", "Say hi."], 1):
                    await talk.ask({"type": "input_text", "text": text})
                    await talk.wait("response.done", n)
                await conn.close()
                return talk
        talk = asyncio.run(go())
    statuses = [e["response"]["status"] for e in talk.of("response.done")]
    assert statuses == ["completed", "failed", "completed", "completed"], statuses
    assert [e["error"]["code"] for e in talk.of("error")] == ["context_length_exceeded"]
    long_item = talk.of("conversation.item.added")[1]["item"]
    assert [e["item_id"] for e in talk.of("conversation.item.deleted")] == [long_item["id"]]
    last_prompt = lm.asked[-1][0]
    assert not any("digits" in m["content"] for m in last_prompt), last_prompt
    assert [m["content"] for m in last_prompt if m["role"] == "user"] == ["Say hi.", "Say hi.", "Say hi."]


def test_the_history_forgets_old_turns_until_the_prompt_fits_the_lms_context_in_tokens():
    """Three 1,900-character messages of digits are 5,700 characters, under `max_prompt_chars`
    (6,000: ~4 characters a token for prose), but ~5,000 tokens: every later turn was refused. With
    the LM's own count (`fits`) the oldest turns are forgotten until the prompt fits its context."""
    from voice.conversation.history import History

    def fits(messages):  # a digit is about a token; a context of 2,048 tokens with 96 for the reply
        return sum(len(m["content"]) for m in messages) + 96 <= 2048

    history = History("Be brief.", turns=8, max_chars=6000, fits=fits)
    for digit in "123":
        prompt = history.messages(digit * 1900)
        assert fits(prompt) and prompt[-1]["content"] == digit * 1900
        history.add(digit * 1900, "Noted.")
    prompt = history.messages("Say hi.")
    assert fits(prompt) and prompt[0]["content"] == "Be brief." and prompt[-1]["content"] == "Say hi."
    assert [m["content"][:1] for m in prompt[1:-1]] == ["3", "N"]  # only the newest turn still fits beside it
    ahead = history.after("Say hi.", "Hi!").messages("")
    assert fits(ahead)


def test_the_turns_the_history_will_keep_are_known_before_it_forgets():
    """`kept` is how the prompt starts once the history forgets (half its window, whole turns), as
    far as those turns are said: what the LM reads aside as each ends (voice/conversation/reply.py)."""
    from voice.conversation.history import History
    for turns in (1, 2, 3, 6, 7):
        history, known = History("Be brief.", turns), []
        for n in range(1, 4 * turns + 3):
            before = len(history.said)
            history.add(f"question {n}", f"answer {n}")
            if len(history.said) < before + 2:  # it forgot: the prompt starts with what was known a turn before
                assert (history.messages("")[:len(known)] == known) if turns >= 3 else not known
                assert len(known) == (0 if turns < 3 else 1 + 2 * ((turns + 1) // 2 - 1))
            known = history.kept()
            assert not known or known[0]["role"] == "system" and known[-1]["content"] == f"answer {n}"
    assert History("Be brief.", 0).kept() == []


def test_a_reply_of_deeply_nested_json_is_no_tool_call_and_no_recursion_error():
    """The tool-call readers of a model's reply (ours, and a remote LM's text) used `json.loads`,
    which raises RecursionError (not a ValueError) on 1,000 nested brackets."""
    from engine.tools import calls_in
    from voice.pipeline.lm import calls_written
    deep = '{"name": "f", "arguments": ' + "[" * 1000 + "]" * 1000 + "}"
    assert calls_in(deep) == [] and calls_in(f"<tool_call>{deep}</tool_call>") == []
    assert calls_written("[" * 1000 + "]" * 1000) == []
    assert calls_in('{"name": "f", "arguments": {"x": [1]}}')[0]["function"]["arguments"] == '{"x": [1]}'


# --- refuse, don't time out -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    from engine.loading import load, packaged_smollm2_gguf
    return load(str(packaged_smollm2_gguf()), max_seq_len=1024)


def test_replies_that_can_no_longer_be_read_in_time_are_refused_newest_first(smol):
    """Affordability was checked at admission only, at the fastest cost ever measured: three
    Realtime clients sending 2,000 characters at once were all admitted, then all ran into the
    20 s timeout (and /healthz said "degraded"). Now it is checked again every round at the cost a
    token has now, times the conversations sharing the model: here the machine turned out three
    times slower than its best, so the two newest are refused (a client's error, no timeout) and
    the first is answered."""
    import asyncio

    from engine.decode import ContextOverflow, DecodeConfig
    from engine.stream import Engine
    eng = Engine(smol, max_seq_len=1024, max_prefill_s=6.0)
    prompts = [[{"role": "user", "content": f"Summarise list {n}: " + ", ".join(f"item {n}.{i}" for i in range(60))}]
               for n in range(3)]
    new = len(eng.prompt_ids(prompts[0]))
    list(eng.generate_sync([{"role": "user", "content": "Hi."}], DecodeConfig(mode="ar", max_new_tokens=2)))  # paged in
    # at best each takes 1.5 s: three fit 6 s at admission
    eng.cost.best_token_s = eng.cost.best_slice_token_s = 1.5 / new
    eng.cost.token_s = 4.5 / new  # ... but lately a token costs three times that

    async def reply(messages):
        try:
            return [p async for p in eng.stream(messages, DecodeConfig(mode="ar", max_new_tokens=4))]
        except ContextOverflow as err:
            return err

    async def main():
        first = asyncio.create_task(reply(prompts[0]))
        await asyncio.sleep(0.05)  # admitted first
        return await asyncio.gather(first, reply(prompts[1]), reply(prompts[2]))

    answered, *refused = asyncio.run(main())
    assert isinstance(answered, list) and answered[-1].done, answered
    assert all(isinstance(r, ContextOverflow) and "still to read" in str(r) for r in refused), refused


# --- engine serve: a short request beside long prompts ---------------------------------------------

def test_long_prompts_chunks_sitting_out_together_share_their_wait(smol):
    """Six long prompts' chunks, each sitting out behind a newcomer for longer than `PREFILL_DEFER`
    times `max_defer_s`: before, one of them was due every round, so each of the newcomer's steps
    took a slice longer (115 s for 8 tokens on the 1.5B). Now each waits that times their number."""
    from types import SimpleNamespace

    import engine.serving.scheduler
    from engine.stream import Engine
    eng = Engine(smol, max_seq_len=512, max_defer_s=0.3)
    patient, now = 0.3 * engine.serving.scheduler.PREFILL_DEFER, time.monotonic()

    def request(used_s: float, rows: int, waited_s: float, left: int = 10_000) -> SimpleNamespace:
        return SimpleNamespace(runs_out=lambda: -math.inf, warm=False, used_s=used_s, ready_since=now - waited_s,
                               rows_left=lambda: left,
                               forward=SimpleNamespace(clean=[1] * rows, draft=[]))

    newcomer = request(0.0, 1, 0.0)
    longs = [request(20.0 + i, 64, patient + 0.1 * (i + 1)) for i in range(6)]
    assert eng.scheduler.this_round([newcomer, *longs]) == [newcomer]
    longs[2].ready_since = now - 6 * patient - 0.01
    assert eng.scheduler.this_round([newcomer, *longs]) == [newcomer, longs[2]]
    assert eng.scheduler.this_round([newcomer, longs[0]]) == [newcomer, longs[0]]  # one alone: as before
    # long prompts that have had less than a slice each so far: the newcomer's prompt goes first
    fresh = [request(0.1 + 0.02 * i, 64, 0.5 + 0.1 * i) for i in range(6)]
    newcomers_prompt = request(0.0, 32, 0.0)
    assert eng.scheduler.this_round([newcomers_prompt, *fresh]) == [newcomers_prompt]
    assert len(eng.scheduler.this_round(longs)) == 1  # no newcomer: one of them goes on every round


def test_a_request_near_its_end_goes_ahead_of_long_prompts_as_little_served(smol):
    """Six ~1,700-token prompts sent 2 s before an 8-token request had had less model time each
    (0.2 s) than the short one's first chunk (0.35 s): least served first, each long prompt's chunk
    went between its two chunks and joined each of its steps (3.68 s, 5.1x alone, on `default`).
    A request with little work left (`short_rows`) goes first, and the long chunks sit out behind
    it as behind a newcomer (`PREFILL_DEFER`, times their number)."""
    from types import SimpleNamespace

    import engine.serving.scheduler
    from engine.stream import Engine
    eng = Engine(smol, max_seq_len=512, max_defer_s=0.3)
    patient, now = 0.3 * engine.serving.scheduler.PREFILL_DEFER, time.monotonic()
    near = eng.scheduler.short_rows

    def request(used_s: float, rows: int, waited_s: float, left: int) -> SimpleNamespace:
        return SimpleNamespace(runs_out=lambda: -math.inf, warm=False, used_s=used_s, ready_since=now - waited_s,
                               rows_left=lambda: left,
                               forward=SimpleNamespace(clean=[1] * rows, draft=[]))

    fresh = [request(0.19 + 0.01 * i, 16, 0.5 + 0.1 * i, 1600) for i in range(6)]
    tail = request(0.35, 11, 0.0, near - 1)  # its prompt's second chunk, after a first more costly than theirs
    assert eng.scheduler.this_round([tail, *fresh]) == [tail]
    step = request(0.7, 1, 0.0, 8)  # its steps: joined by no long chunk
    assert eng.scheduler.this_round([step, *fresh]) == [step]
    fresh[3].ready_since = now - 6 * patient - 0.01  # ... for at most their shared wait
    assert eng.scheduler.this_round([step, *fresh]) == [step, fresh[3]]
    far = request(0.2, 1, 0.0, near + 1)  # a reply with much left: least served first, as before
    assert eng.scheduler.this_round([far, *fresh[:3]]) == [far, fresh[0]]


def test_engine_serve_keeps_every_request_waited_for():
    """An HTTP client waits for its whole reply: engine serve's requests' readers run out of text now
    (-inf) after their first piece too (before, they had slack: a short request sat out behind long
    prompts still being read)."""
    from engine.api.server import build_app
    from engine.decode import DecodeConfig
    asked = []

    class Recording(EncodingEngine):
        async def stream(self, messages, cfg, conversation, constraint=None, tools=None, deadline=None):
            asked.append(deadline)
            async for piece in super().stream(messages, cfg, conversation, constraint, tools):
                yield piece

    with serving(build_app(Recording(), DecodeConfig(max_new_tokens=8))) as port:
        still_answers(port)
    assert len(asked) == 1 and asked[0] is not None and asked[0]("Hello there.") == -math.inf


def test_a_request_without_room_in_the_shared_kv_cache_waits_its_turn(smol):
    """llama.cpp's KV cache is shared: six ~1,700-token prompts on the 1.5B (8,192 tokens) were all
    started, and two failed with "the LM's cache is full" after 112 s of work. Now a request whose
    prompt and reply do not fit beside those running waits until they do (first come, first
    served), and idle caches kept for continuations give theirs up for it."""
    import asyncio

    from engine.decode import DecodeConfig
    from engine.stream import Engine
    eng = Engine(smol, max_seq_len=512)
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    prompts = [[{"role": "user", "content": f"Name {n} fruits."}] for n in (2, 3, 4)]
    need = max(len(eng.prompt_ids(p)) for p in prompts) + cfg.max_new_tokens
    eng.admission.kv_tokens = 2 * need + need // 2  # room for two at a time
    released: list[int] = []
    eng.admission.release_idle = released.append
    events: list[tuple[str, int]] = []

    async def reply(n: int):
        async for _ in eng.stream(prompts[n], cfg):
            events.append(("piece", n))
        events.append(("done", n))

    async def main():
        await asyncio.gather(*(reply(n) for n in range(3)))

    asyncio.run(main())
    third_starts = events.index(("piece", 2))
    assert ("done", 0) in events[:third_starts] or ("done", 1) in events[:third_starts], events
    assert sorted(n for kind, n in events if kind == "done") == [0, 1, 2]
    assert released and all(0 <= tokens <= eng.admission.kv_tokens for tokens in released)
    assert not eng.scheduler.queued


def test_a_short_request_with_room_goes_ahead_of_a_long_one_waiting_for_room(smol):
    """Six 1,609-token prompts on the 1.5B (8,192 cells): five fit, the sixth waited for room, and an 8-token
    request sent beside them, which fitted, waited behind it, first come first served, for 147 s (237x alone).
    A short request (prompt and reply within `short_rows`) with room now goes ahead of those waiting."""
    import asyncio

    from engine.decode import DecodeConfig
    from engine.stream import Engine
    eng = Engine(smol, max_seq_len=512)
    long_cfg, short_cfg = DecodeConfig(mode="ar", max_new_tokens=6), DecodeConfig(mode="ar", max_new_tokens=2)
    filler = " ".join(["apples pears plums"] * 60)
    longs = [[{"role": "user", "content": f"Name {n} fruits from this list: {filler}"}] for n in (2, 3, 4)]
    short = [{"role": "user", "content": "Hi."}]
    need = max(len(eng.prompt_ids(p)) for p in longs) + long_cfg.max_new_tokens
    short_need = len(eng.prompt_ids(short)) + short_cfg.max_new_tokens
    assert short_need <= eng.scheduler.short_rows < need  # what the test is about
    eng.admission.kv_tokens = 2 * need + short_need  # two long ones and the short one
    events: list[tuple[str, str]] = []

    async def reply(name: str, messages: list[dict], cfg: DecodeConfig, after: float = 0.0):
        await asyncio.sleep(after)
        async for _ in eng.stream(messages, cfg):
            events.append(("piece", name))
        events.append(("done", name))

    async def main():
        await asyncio.gather(*(reply(f"long{n}", longs[n], long_cfg) for n in range(3)),
                             reply("short", short, short_cfg, after=0.05))

    asyncio.run(main())
    first_done = min(events.index(("done", "long0")), events.index(("done", "long1")))
    assert events.index(("done", "short")) < first_done, events  # it did not wait for a long one to end
    assert sorted(n for kind, n in events if kind == "done") == ["long0", "long1", "long2", "short"]
    assert not eng.scheduler.queued


def test_kept_conversations_give_up_their_caches_least_recently_used_first():
    from engine.api.server import PrefixCaches
    from engine.decode import CacheState
    from engine.stream import ConversationCache
    abandoned: list = []

    class Engine:
        abandon = abandoned.append

        class admission:  # where PrefixCaches hands its `release`
            release_idle = None

    caches = PrefixCaches(Engine(), 8)
    kept = [ConversationCache(state=CacheState([], ids=[0] * 100)) for _ in range(3)]
    for n, conversation in enumerate(kept):
        caches.keep([{"role": "user", "content": f"question {n}"}], "answer", conversation, False)
    caches.release(150)
    assert abandoned == kept[:2]
    caches.release(100)
    assert abandoned == kept[:2]
