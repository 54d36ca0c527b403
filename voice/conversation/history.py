"""What the LM sees of a conversation: the system prompt, recent turns, and the new question."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from voice.config import LmConfig


class History:
    """The turns the user finished, each with what they actually heard of the reply (a barge-in
    cuts it). Old turns are forgotten half a window at a time, not one per turn: a window that
    slides every turn changes the prompt's start, and the LM would prefill the whole conversation
    again. `turns = 0` keeps none. Long turns are forgotten sooner: the prompt stays within
    `max_chars` (a first cut), then within the LM's context by its own tokenizer (`fits`, where
    the LM has one: 1,900 characters of digits are ~1,900 tokens, not ~475), the system prompt and
    the new question kept whole."""

    def __init__(self, system_prompt: str, turns: int, max_chars: int = LmConfig.max_prompt_chars,
                 fits: Callable[[list[dict]], bool] | None = None):
        self.system_prompt, self.turns, self.max_chars, self.fits = system_prompt, turns, max_chars, fits
        self.said: list[dict] = []

    def __iter__(self) -> Iterator[dict]:
        return iter(self.said)

    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def messages(self, user_text: str) -> list[dict]:
        system = self._system()
        self._fit(len(self.system_prompt) + len(user_text))
        while True:
            prompt = system + (self.said if self.turns else []) + [{"role": "user", "content": user_text}]
            if not (self.turns and self.said and self.fits is not None and not self.fits(prompt)):
                return prompt
            self._forget_oldest()

    def _fit(self, kept: int) -> None:
        """Forget the oldest turns until they fit beside `kept` characters in `max_chars`."""
        while self.said and kept + sum(len(m["content"]) for m in self.said) > self.max_chars:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        del self.said[0]  # the oldest user message, then the reply it had
        while self.said and self.said[0]["role"] == "assistant":
            del self.said[0]

    def add(self, user_text: str, heard: str) -> None:
        self.said.append({"role": "user", "content": user_text})
        if heard:
            self.said.append({"role": "assistant", "content": heard})
        turns = max(self.turns, 1)
        if len(self.said) > 2 * turns:  # forget down to half the turns (whole turns: it starts with a user's)
            del self.said[:len(self.said) - 2 * ((turns + 1) // 2)]
            while self.said and self.said[0]["role"] == "assistant":
                del self.said[0]

    def greeted(self, heard: str) -> None:
        """The assistant spoke first (a phone call's greeting) and was heard saying `heard`: its first words
        (said again, once the greeting ended, they replace what it was going to say)."""
        if self.said and self.said[0]["role"] == "assistant":
            del self.said[0]
        if heard:
            self.said.insert(0, {"role": "assistant", "content": heard})

    def after(self, user_text: str, heard: str) -> History:
        """The history once this turn ends with `heard` (what `add` would keep), this one unchanged:
        for preparing the LM while the reply is spoken (`messages("")`, `kept`)."""
        later = History(self.system_prompt, self.turns, self.max_chars, self.fits)
        later.said = list(self.said)
        later.add(user_text, heard)
        return later

    def kept(self) -> list[dict]:
        """How the prompt will start once the history next forgets, as far as those turns are said
        (if every turn until then adds a question and a reply): the LM reads it aside a turn at a
        time, where it would read it all on the turn after the forgetting (~90 tokens on two busy
        cores: up to seconds). Empty while none of the turns it will keep is said."""
        if not self.turns:
            return []
        said = {id(m) for m in self.said}
        later = History(self.system_prompt, self.turns)
        later.said = list(self.said)
        while True:  # placeholder turns until it forgets
            before = len(later.said)
            later.add("?", "?")
            if len(later.said) <= before:
                break
        kept = [m for m in later.said if id(m) in said]
        return self._system() + kept if kept else []

    def heard_only(self, text: str) -> None:
        """The last reply was heard only up to `text` (a Realtime client's truncate): keep that."""
        for i in range(len(self.said) - 1, -1, -1):
            if self.said[i]["role"] == "assistant":
                if text:
                    self.said[i] = {"role": "assistant", "content": text}
                else:
                    del self.said[i]
                return

    def take_unanswered(self) -> str:
        """The last user message if nothing answered it (its reply only called functions), removed:
        it is asked again with their results."""
        if self.said and self.said[-1]["role"] == "user":
            return self.said.pop()["content"]
        return ""
