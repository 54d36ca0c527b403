"""The LM stage: the one door into `engine/`, or to any OpenAI-compatible endpoint.

`reply(messages)` yields committed text blocks as they are final; closing the iterator
(barge-in) cancels generation. Each session gets its own `Chat` so a local engine keeps the
conversation's prefix cached between turns.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from voice.config import LmConfig


@dataclass
class Block:
    text: str
    tokens: int = 0  # reply tokens so far (0 when the backend doesn't say)
    steps: int = 0


class LocalLM:
    """The in-process diffusion engine, shared by all sessions."""

    def __init__(self, config: LmConfig):
        import torch

        from engine.decode import DecodeConfig
        from engine.stream import Engine
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.decode = DecodeConfig(mode=config.mode, max_new_tokens=config.max_new_tokens,
                                   block_size=config.block_size, first_block_size=config.first_block_size,
                                   threshold=config.threshold)
        self.engine = Engine.load(config.model, adapter=config.adapter or None, defaults=self.decode,
                                  max_batch=config.max_batch)

    def chat(self) -> "LocalChat":
        return LocalChat(self)


class LocalChat:
    def __init__(self, lm: LocalLM):
        from engine.stream import Conversation
        self.lm, self.conversation = lm, Conversation()

    async def reply(self, messages: list[dict], mode: str | None = None) -> AsyncIterator[Block]:
        overrides = {"mode": mode} if mode else {}
        async for piece in self.lm.engine.stream(messages, conversation=self.conversation, **overrides):
            if piece.text:
                yield Block(piece.text, piece.tokens, piece.steps)


class RemoteLM:
    """Any OpenAI-compatible chat endpoint (our `engine serve`, a hosted diffusion LM, SGLang...)."""

    def __init__(self, config: LmConfig):
        import openai
        self.config = config
        self.client = openai.AsyncOpenAI(base_url=config.url, api_key=os.environ.get(config.api_key_env, "none"),
                                         max_retries=2)

    def chat(self) -> "RemoteChat":
        return RemoteChat(self)


class RemoteChat:
    def __init__(self, lm: RemoteLM):
        self.lm = lm

    async def reply(self, messages: list[dict], mode: str | None = None) -> AsyncIterator[Block]:
        cfg = self.lm.config
        stream = await self.lm.client.chat.completions.create(
            model=cfg.model, messages=messages, stream=True, max_tokens=cfg.max_new_tokens, temperature=0,
            extra_body={"mode": mode or cfg.mode})
        try:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield Block(chunk.choices[0].delta.content)
        finally:
            await stream.close()


def load_lm(config: LmConfig) -> LocalLM | RemoteLM:
    return LocalLM(config) if config.backend == "local" else RemoteLM(config)
