"""The scheduler: one thread owns the model and runs every request's forwards in rounds.

Every round it advances each active request to its next forward (a denoising step, or an AR token)
and runs up to `max_batch` of them as one batched pass, so concurrent conversations share
block-denoising steps instead of queueing behind each other (continuous batching at block-step
granularity). Each round is ordered by when each request's reader runs out of text
(`Request.runs_out`: -inf for a reply that has not delivered a piece yet, someone waits for it now;
for the voice service, when the listener's queued audio runs out): those that run out within
`horizon_s` are waited for and go first, the earliest first; the others sit out, each forward at
most `max_defer_s`, so they are delayed, never starved; so do they, even alone, while someone waits
outside the engine (`someone_waits`); and a warm (reading ahead, nobody waits for it) for as long as
anyone waits or a reader would run out of text while its rows are read (`slack_for`); it is not
stopped when someone starts waiting (mostly its own user, whose reply goes on from it). Among the
waited-for that wait alike (-inf:
now; inf: on no clock) the least served go first (each is charged its rows' share of the model time
of the batches it was in); one with a deadline goes by it. A prompt is prefilled in chunks of about
`SLICE_S` of model time, one chunk a round: a conversation that sends a long prompt cannot hold the
model from the others' steps, and a newcomer goes ahead of it; so does a request near its end
(`short_rows`), however little the long prompts beside it have had so far; and a step whose reader
runs out of text before a chunk beside it would be read goes in a forward of its own first
(`batches`). Nor does a newcomer wait for the chunk under way when it comes: a forward of long
prompts' chunks only stops when someone starts waiting (`interrupt`: a new request, or the voice
service's speech recognition or synthesis for a silent user), on kernels that can stop one
(llama.cpp), and is read again after the others' turn. Cancelling a request (barge-in) drops it at
the next round; the cache invariant in `engine.decode` keeps the conversation consistent.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from engine.decode import Forward, Steps, run_many
from engine.runtime import Interrupted, Model
from engine.serving import probes
from engine.serving.admission import Admission
from engine.serving.caches import CachePool
from engine.serving.cost import MIN_PREFILL_CHUNK, PrefillCost
from engine.serving.requests import Reply, Request, Superseded

log = logging.getLogger("engine.stream")

# A prompt is prefilled in chunks of about this much model time, so a conversation's long prompt
# holds the CPU from the others' steps at most this long at a time (an OS scheduler's quantum).
SLICE_S = 0.25
FIRST_PREFILL_CHUNK = 64  # before a forward has measured what a prompt token costs here
# A request alone prefills this many slices a forward: small chunks cost throughput (the 1.5B on
# two Zen 3 cores: 48 tokens/s in chunks of 16, 62 in chunks of 64, 65 in chunks of 512), but a
# reply that arrives meanwhile waits for the whole chunk (four slices of a 1,500-character message
# took 1.35 s on two Zen 5 cores beside speech recognition): so only while nobody else may come
# (`Admission.may_share`).
ALONE_SLICES = 4
# A prompt's chunk that sits out behind a less served request of its level (a newcomer's reply)
# rejoins after this many times `max_defer_s`, a one-row step after `max_defer_s`: a chunk makes the
# round it joins a slice longer, a step hardly at all. So does a long prompt's chunk (its request
# has had more than `ALONE_SLICES` slices) while other work that someone waits for shares the
# cores (`Scheduler.yield_to`: the voice service's speech recognition and synthesis). Chunks that sit
# out together share that wait: each rejoins after it times their number, so beside six long
# prompts a newcomer's steps are joined by about one chunk per `PREFILL_DEFER * max_defer_s`, not
# one every round (`engine serve`: an 8-token request beside six ~1,700-token prompts).
PREFILL_DEFER = 4

# What a reply whose reader runs out of text soon still needs once the forward it is in ends: a few more
# steps for its next phrase, then that phrase's synthesis (the voice service's; ~0.1-0.2 s on two busy
# cores). A step whose reader runs out before a prompt's chunk beside it is read and this much more is
# hurried: it goes in a forward of its own first.
HURRY_S = 0.5

# What a request is to a round, from when its reader runs out of text (`Scheduler.level`): sits out even
# alone (a warm, or anything not waited for while someone waits outside the engine) | runs when nothing
# waited for is there | waited for: goes first.
BACKGROUND, NORMAL, WAITED = 0, 1, 2

# Plans an admitted request's steps beside `others` being served (the engine's: a reply or a probe).
Plan = Callable[[Request, int], tuple[Steps, Reply]]


def _chunk(request: Request) -> bool:
    """Is the request's next forward a stretch of its prompt (several rows written at once)?"""
    return request.forward is not None and len(request.forward.clean) > 1


def _long_prompt(request: Request) -> bool:
    """Is the request's next forward a chunk of a long prompt (one that has had more than
    `ALONE_SLICES` slices already)? Such a chunk gives way to work someone waits for."""
    return _chunk(request) and request.used_s > ALONE_SLICES * SLICE_S


class Scheduler:
    def __init__(self, model: Model, cost: PrefillCost, admission: Admission, pool: CachePool, plan: Plan,
                 max_batch: int = 8, max_defer_s: float = 0.3):
        """`max_defer_s`: how long a forward not waited for may sit out rounds."""
        self.model, self.cost, self.admission, self.pool, self.plan = model, cost, admission, pool, plan
        self.max_batch, self.max_defer_s = max_batch, max_defer_s
        # A request whose reader runs out of text within this is waited for (the voice service: the
        # few forwards of its next phrase, before the listener's audio runs out).
        self.horizon_s = 0.0
        # Does someone wait in silence outside the engine now (the voice service: for a final
        # transcript or a first phrase)? Then what nobody waits for sits out, even alone.
        self.someone_waits: Callable[[], bool] = lambda: False
        self.clock: Callable[[], float] = time.monotonic  # the deadlines' clock
        # Is work someone waits for running beside the engine on the same cores now?
        self.yield_to: Callable[[], bool] = lambda: False
        self.forwards = 0  # batched forwards run so far
        self.interrupted = 0  # forwards stopped by `interrupt` (read again later)
        self.batch_sizes: list[int] = []  # recent forwards' batch sizes, for benchmarks
        self.sharing = False  # more than one request is active (the scheduler's view)
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.queued: list[Request] = []  # waiting for room in the shared KV cache, first come first served
        self.thread: threading.Thread | None = None

    def submit(self, request: Request) -> None:
        """Hand `request` to the scheduler thread (started with the first)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="engine-scheduler", daemon=True)
            self.thread.start()
        self.inbox.put(request)

    def interrupt(self) -> None:
        """Someone waits now (a new request; the voice service's speech recognition or synthesis
        for a silent user): a forward of long prompts' chunks only, running now, stops (on kernels
        that can stop one) and its chunks are read again after the others' turn, so nobody waits
        for a chunk already under way."""
        self.model.interrupt()

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill forward while others share the model: about `SLICE_S` of model time."""
        if self.cost.token_s is None:
            return FIRST_PREFILL_CHUNK
        return max(MIN_PREFILL_CHUNK, int(SLICE_S / self.cost.token_s))

    def chunking(self, background: bool = False) -> Callable[[], int]:
        """A request's prefill chunk, asked before each: `ALONE_SLICES` times the shared one while
        it has the model to itself and nobody else may come (`may_share`), unless it is a warm
        (someone may come and wait any moment) or a token's cost is not measured yet."""
        return lambda: self.prefill_chunk * (1 if background or self.sharing or self.cost.token_s is None
                                             or self.admission.may_share else ALONE_SLICES)

    def run(self) -> None:
        """The thread: admit, refuse, pick the round, run its forwards in batches; forever."""
        active: list[Request] = []
        while True:
            self.admit_new(active, timeout=0 if active or self.queued else None)
            self.admission.refuse_late(active)
            self.sharing = len(active) > 1  # (before `ready` plans the next forwards and their chunks)
            batch_from = self.this_round(self.ready(active))
            if not batch_from:  # everyone sits out this round: look for newcomers meanwhile
                self.admit_new(active, timeout=0.005)
                continue
            for batch in self.batches(batch_from):
                self.run_batch(batch)

    def batches(self, round_: list[Request]) -> list[list[Request]]:
        """The round's forwards, `max_batch` rows each, in its order; but the steps whose readers run out
        of text before a prompt's chunk beside them would be read (at what a token costs lately) and
        their next phrase made (`HURRY_S`) go first, in forwards of their own. On two cores a chunk of
        10-34 prompt tokens of the 1.5B took 0.2-0.7 s, a step 35-50 ms: three talkers' replies went
        silent mid-sentence for the length of each newcomer's chunk. The chunk's reader waits a step
        longer."""
        chunk = next((r for r in round_ if _chunk(r)), None)
        hurried: list[Request] = []
        if chunk is not None and chunk.forward is not None and self.cost.token_s is not None:
            read_by = self.clock() + len(chunk.forward.clean) * self.cost.token_s + HURRY_S
            hurried = [r for r in round_ if r is not chunk and r.runs_out() < read_by]
        rest = [r for r in round_ if all(r is not h for h in hurried)]
        return [group[i:i + self.max_batch] for group in (hurried, rest) for i in range(0, len(group), self.max_batch)]

    def run_batch(self, batch: list[Request]) -> None:
        """One batched forward of `batch`'s planned forwards; each request gets its result."""
        self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
        forwards = cast("list[Forward]", [request.forward for request in batch])  # `ready` planned them
        rows = [len(f.clean) + len(f.draft) for f in forwards]
        results: Sequence[object] | None
        began = time.perf_counter()
        try:
            results = run_many(self.model, forwards, interruptible=all(map(_long_prompt, batch)))
        except Interrupted:
            results = None
        except Exception as err:  # one bad batch fails its requests, not the scheduler
            log.exception("batched forward failed")
            results = [err] * len(batch)
        took = time.perf_counter() - began
        for request, n in zip(batch, rows):  # each is charged its rows' share, stopped or not
            request.used_s += took * n / max(sum(rows), 1)
        if results is None:  # the same forwards, planned still, sit out as if deferred
            self.interrupted += 1
            log.debug("a forward of %d rows of long prompts stopped after %.0f ms: someone waits",
                      sum(rows), 1000 * took)
            for request in batch:
                request.ready_since = self.clock()
            return
        self.measure(forwards, took)
        for request, result in zip(batch, results):
            request.result, request.forward = result, None

    def measure(self, forwards: list[Forward], took: float) -> None:
        """Learn what a prompt token costs from forwards of many rows (prefill, mostly); not from
        the first forward, which also pages the weights in (8 s for 64 tokens of the 1.5B here)."""
        self.forwards += 1
        if self.forwards > 1:
            self.cost.learn(sum(len(f.clean) + len(f.draft) for f in forwards), took, self.prefill_chunk)

    def admit_new(self, active: list[Request], timeout: float | None) -> None:
        """Admit the queued requests there is room for now, then whatever is in the inbox, first
        waiting up to `timeout` s for it (None: forever)."""
        while self.queued and (self.queued[0].cancelled or self.admission.room_for(self.queued[0], active)):
            request = self.queued.pop(0)
            if not request.cancelled:  # (one whose caller left was never admitted: nothing to let go)
                self.admit(request, active, queued=True)
        for request in [r for r in self.queued[1:] if self._passes(r, active)]:
            self.queued.remove(request)
            self.admit(request, active, queued=True)
        if timeout is None and (active or self.queued):
            timeout = 0
        try:
            request = self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
            while True:
                self.admit(request, active)
                request = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def ready(self, active: list[Request]) -> list[Request]:
        """Plan each request's next forward (finished and cancelled requests leave `active`)."""
        for request in list(active):
            if request.forward is None or request.cancelled:
                request.forward, request.ready_since = self.advance(request), self.clock()
                if request.forward is None:
                    active.remove(request)
        return active

    def level(self, runs_out: float, warm: bool, now: float, someone_waits: bool) -> int:
        """WAITED if a request's reader runs out of text within `horizon_s` (-inf: waits now); else
        BACKGROUND if it is a warm, or someone waits outside the engine; else NORMAL."""
        if runs_out - now < self.horizon_s:
            return WAITED
        return BACKGROUND if warm or someone_waits else NORMAL

    def this_round(self, ready: list[Request]) -> list[Request]:
        """Of the highest level present (unless that is BACKGROUND), each with a deadline and the
        least served of those that wait alike: a newcomer goes ahead of a conversation that has had
        the model for a while (a long prompt's prefill); a reply whose listener's audio runs out goes
        by when it does, however much it has had (least served first held a long reply about to run
        dry behind a newcomer or a shorter reply, up to `max_defer_s` a forward); in that order, the
        earliest deadline first (rows beyond `max_batch` go in the round's later forwards). And those
        that have sat out `max_defer_s` (a prompt's chunk behind a newcomer of its level, or a long
        prompt's while `yield_to`, `PREFILL_DEFER` times that, and as many times again as such chunks
        sit out together: with six long prompts one of them was due every round, and each of a
        newcomer's steps took a slice longer). A request near its end (`short_rows`) counts as least
        served, and the chunks of longer requests sit out behind it: least served alone did not tell an
        8-token request from six long prompts that had had as little as it (each went between its two
        chunks and joined each of its steps). So does a newcomer's chunk behind voice replies near their
        ends, up to `PREFILL_DEFER` x `max_defer_s` (s2's 11th turn at three talkers: 0.9-1.3 s); letting
        it through doubled the others' silences mid-reply (BENCHMARKS.md, "the turns the history keeps")."""
        now, someone_waits = self.clock(), self.someone_waits()
        runs_out = {id(r): r.runs_out() for r in ready}
        levels = [self.level(runs_out[id(r)], r.warm, now, someone_waits) for r in ready]
        top = max(levels, default=NORMAL)
        least = min((r.used_s for r, level in zip(ready, levels) if level == top), default=0.0)
        yielding = self.yield_to()
        near = {id(r) for r, level in zip(ready, levels)
                if level == top > BACKGROUND and r.rows_left() <= self.short_rows}

        def front(request: Request, level: int) -> bool:
            if level != top or top == BACKGROUND:
                return False
            if id(request) in near or math.isfinite(runs_out[id(request)]):
                return True
            return request.used_s <= least + SLICE_S and not (near and _chunk(request))
        fronts = [front(r, level) for r, level in zip(ready, levels)]
        behind_chunks = sum(1 for r, level, f in zip(ready, levels, fronts) if level == top > BACKGROUND
                            and _chunk(r) and not f)

        def due(request: Request, level: int, first: bool) -> bool:
            waited, patient = now - request.ready_since, self.max_defer_s * PREFILL_DEFER
            if yielding and _long_prompt(request) and waited < patient:
                return False
            if first:
                return True
            if request.warm and (someone_waits or not self.slack_for(request, runs_out.values(), now)):
                # however long: nobody waits for a warm, and its chunk (0.35-0.74 s of 16-34 tokens of the 1.5B on
                # two busy cores, due after max_defer_s) silenced the replies playing beside it mid-sentence
                return False
            behind = level == top > BACKGROUND and _chunk(request)
            return waited >= (patient * max(1, behind_chunks) if behind else self.max_defer_s)
        chosen = [r for r, level, f in zip(ready, levels, fronts) if due(r, level, f)]
        # One prompt chunk a round: a round is then at most a slice longer than its steps, and a
        # reply that arrives meanwhile waits for at most that. First one deferred long enough (the
        # one that has waited longest), else the one nearest its end, else the least served's: a
        # newcomer's prompt goes ahead of long prompts that have had less than a slice each so far
        # (six sent 2 s before an 8-token request each went first, a chunk of seconds on a loaded
        # machine).
        front_of = {id(r): f for r, f in zip(ready, fronts)}

        def order(r: Request) -> tuple[bool, int, float, float]:
            if not front_of[id(r)]:
                return False, 0, 0.0, r.ready_since
            return True, r.rows_left() if id(r) in near else self.short_rows + 1, r.used_s, r.ready_since
        chunks = sorted((r for r in chosen if _chunk(r)), key=order)
        return sorted([r for r in chosen if not _chunk(r)] + chunks[:1], key=lambda r: runs_out[id(r)])

    def slack_for(self, warm: Request, deadlines: Iterable[float], now: float) -> bool:
        """May a warm's forward run now, nobody waiting for it? Only while nobody waits for a first piece
        and every reader has text for the warm's rows (at what a token costs lately) and `HURRY_S` more,
        so it runs in whatever slack there is: sitting out while any reply was being read (audio running
        out within `horizon_s`), it ran in none beside three talkers, and the history's re-read (~90
        tokens once it forgets half its turns) landed on the next turn's first block. (On two saturated
        Zen 4 cores even this slack is rare: the voice service reads the turns the history will keep a
        turn at a time, `History.kept`.) A warm's chunk in a forward of its own that stopped should it
        still run when a reader needed its next step was tried: it stopped 0-5 forwards a run, silence
        mid-reply did not change beyond the noise, and v2v p95 at three talkers rose in 5 of 6 pairs
        (BENCHMARKS.md, "a warm that runs late")."""
        rows = len(warm.forward.clean) if warm.forward is not None else 0
        reading = rows * self.cost.token_s if self.cost.token_s is not None else math.inf
        return all(runs_out >= now + reading + HURRY_S for runs_out in deadlines)

    @property
    def short_rows(self) -> int:
        """A request with at most this many rows of work left (its prompt's unread tokens and its
        reply's tokens) is near its end: `ALONE_SLICES` prefill chunks' worth (an 8-token reply to
        a one-line question is; a ~1,700-token prompt is not)."""
        return ALONE_SLICES * self.prefill_chunk

    def admit(self, request: Request, active: list[Request], queued: bool = False) -> None:
        """Start the request beside `active`; or, on a shared KV cache without room for it now, queue
        it until there is (a request failing with "the LM's cache is full" after minutes of work, as
        two of six ~1,700-token prompts did on the 1.5B, is worse than one that waits its turn)."""
        conversation = request.conversation
        if not queued and not request.warm and request.probe is None and \
                not (self._passes(request, active) if self.queued else self.admission.room_for(request, active)):
            self.queued.append(request)
            return
        others = sum(1 for r in active if not r.warm and r.conversation is not conversation)  # someone waits on them
        if request.probe is None and isinstance(conversation.active, Request) and conversation.active in active:
            replying = not (conversation.active.warm or conversation.active.cancelled)
            if request.warm and replying:  # nobody waits for a warm; someone waits for the reply
                request.deliver(Superseded("a reply runs on this conversation: it reads its own prompt"))
                return
            active.remove(conversation.active)
            conversation.active.deliver(Superseded("a newer request on this conversation took its place"))
        try:  # a probe runs beside the conversation's reply, on a copy of its cache
            request.steps, request.reply = self.plan(request, others)
        except Exception as err:  # noqa: BLE001 - the request that caused it gets it, the others go on
            request.deliver(err)
            self.leave(request)
            return
        if request.probe is None:
            conversation.active = request
        active.append(request)

    def _passes(self, request: Request, active: list[Request]) -> bool:
        """May `request` start ahead of those queued for room? When it is short (its prompt and reply within
        `short_rows`) and has room now: first come, first served alone made an 8-token request wait 147 s behind
        the sixth of six 1,609-token prompts on the 1.5B (8,192 cells: five fit, the sixth waited for one to end,
        the short one, which fitted, behind it). A short request holds its few cells briefly, so the one it
        passes waits no longer for the cells it needs."""
        needs = self.admission.tokens(request)
        return not request.cancelled and needs is not None and needs <= self.short_rows \
            and self.admission.room_for(request, active)

    def advance(self, request: Request) -> Forward | None:
        """Run the request's decoder up to its next forward, handing out blocks on the way."""
        assert request.steps is not None and request.reply is not None  # set when admitted
        if request.cancelled:
            request.steps.close()
            self.leave(request)
            return None
        try:
            while True:
                if isinstance(request.result, BaseException):
                    raise request.result
                item = request.steps.send(request.result)
                request.result = None
                if isinstance(item, Forward):
                    return item
                request.deliver(request.reply.piece(item))
        except StopIteration:
            request.deliver(None)
        except Exception as err:  # noqa: BLE001 - the request that caused it gets it, the others go on
            request.deliver(err)
        self.leave(request)
        return None

    def leave(self, request: Request) -> None:
        """The request is over (finished, failed or cancelled): its conversation lets go of it (else
        the two keep each other, and the cache, alive until a full garbage collection), and an
        abandoned conversation's cache (a one-off's, or one Engine.abandon was called for) goes back
        to the pool."""
        with self.pool.leave_lock:
            if request.probe is not None:
                probes.settle(request.probe, request.conversation, self.pool)
                return
            if request.conversation.active is request:
                request.conversation.active = None
            if request.conversation.abandoned:
                self.pool.give_back(request.conversation)
