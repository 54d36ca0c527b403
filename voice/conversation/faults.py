"""Each stage's work under its timeout, and what a failure of it is: one classification for every front.

A stage that fails or overruns its `[faults]` timeout becomes a `StageFailure` (which stage, a timeout
or an error, or the client's own doing). The native session and the Realtime, Twilio and SIP fronts
end the turn with it and the apology (voice/conversation/reply.py); Wyoming answers with its own events. Either
way the failure is reported to `Instance.fault`, so /healthz and `voice_stage_faults` see every front's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import numpy as np

from voice.config import FaultsConfig
from voice.pipeline.lm import Piece
from voice.pipeline.tts import SpeechSynthesizer

log = logging.getLogger("voice.faults")


class StageFailure(Exception):
    """A stage failed or overran its timeout: the turn ends with `code`. `stage` is asr, lm, tts or
    session; `kind` is timeout, error, or client (this client's input caused it: no service fault)."""

    def __init__(self, code: str, message: str, stage: str, kind: str):
        super().__init__(message)
        self.code, self.message, self.stage, self.kind = code, message, stage, kind


def client_caused(err: BaseException) -> bool:
    """Did the LM fail because of what this client sent, rather than being broken? A conversation
    too long for its context (engine ContextOverflow), text it cannot encode, or a remote LM
    answering 400/413/422. Such a failure ends the turn like any other but is no service fault."""
    if isinstance(err, UnicodeError) or overflow(err):
        return True
    return getattr(err, "status_code", None) in (400, 413, 422)


def overflow(err: BaseException) -> bool:
    """The engine's ContextOverflow: the conversation does not fit the context, or would take the
    local LM longer than the first block's timeout to read (named, not imported: the engine
    loads only with the local LM)."""
    return any(c.__name__ == "ContextOverflow" for c in type(err).__mro__)


async def transcript_within(transcript: Awaitable[str], faults: FaultsConfig) -> str:
    """The final transcript, stripped, within `asr_timeout_s`."""
    timeout = faults.asr_timeout_s
    try:
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a barge-in's cancel
            return (await transcript).strip()
    except TimeoutError:
        raise StageFailure("asr_timeout", f"speech recognition took longer than {timeout:g} s", "asr",
                           "timeout") from None
    except Exception as err:
        log.warning("speech recognition failed: %r", err)
        raise StageFailure("asr_failed", f"speech recognition failed: {err}", "asr", "error") from err


async def blocks_within(blocks: AsyncIterator[Piece], faults: FaultsConfig) -> AsyncGenerator[Piece, None]:
    """The LM's blocks, the first within `lm_first_block_timeout_s`, each next within
    `lm_block_timeout_s`; the stream is closed however this ends (iterate it in `aclosing`)."""
    count = 0
    try:
        while True:
            timeout = faults.lm_first_block_timeout_s if count == 0 else faults.lm_block_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    block = await anext(blocks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                which = "first block" if count == 0 else f"block {count + 1}"
                raise StageFailure("reply_timeout", f"the language model took longer than {timeout:g} s for its "
                                                    f"{which}", "lm", "timeout") from None
            except (StageFailure, asyncio.CancelledError):
                raise
            except Exception as err:
                if client_caused(err):  # this conversation, not the service: no fault in /healthz
                    code = "context_length_exceeded" if overflow(err) else "reply_failed"
                    raise StageFailure(code, f"the language model could not take this conversation: {err}"[:300],
                                       "lm", "client") from err
                raise StageFailure("reply_failed", f"the language model failed: {err}", "lm", "error") from err
            count += 1
            yield block
    finally:
        close = getattr(blocks, "aclose", None)
        if close is not None:
            try:
                async with asyncio.timeout(5.0):
                    await close()
            except Exception as err:  # noqa: BLE001 - the reply is done: log it, go on
                log.warning("closing the LM stream failed: %r", err)


async def synthesis_within(synthesizer: SpeechSynthesizer, phrase: str, rate: int, faults: FaultsConfig,
                           urgent: Callable[[], bool]) -> np.ndarray:
    """One phrase's PCM16 at `rate`, within `tts_timeout_s`."""
    timeout = faults.tts_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await synthesizer.synthesize(phrase, rate, urgent=urgent)
    except TimeoutError:
        raise StageFailure("reply_timeout", f"speech synthesis took longer than {timeout:g} s", "tts",
                           "timeout") from None
    except Exception as err:
        log.warning("speech synthesis failed: %r", err)
        raise StageFailure("reply_failed", f"speech synthesis failed: {err}", "tts", "error") from err
