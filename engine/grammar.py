"""Constrained decoding: replies that must be JSON (any object, or one matching a JSON schema).

A `Constraint` wraps an llguidance matcher (chosen by measurement: BENCHMARKS.md, "Constrained
decoding"): before each token is chosen, the logits of every token that would leave the output
no longer a valid prefix of the grammar are set to -inf, and the chosen token is consumed. The
decoders apply it to every row that commits a token (engine.decode), so greedy replies are the
base model's greedy replies under the constraint, with `verify` as with AR; drafted tokens are
cut at the first one the grammar refuses, since the base could not commit it anyway. Once the
grammar is complete only the end-of-turn token is allowed. JSON is written in one layout,
`{"a": 1, "b": [2, 3]}`.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.torch
import torch
from torch import Tensor

from engine.tokenizer import Tokenizer


# One fixed JSON layout, `{"a": 1, "b": [2, 3]}`: flexible whitespace lets a small model wander
# into runs of blank lines that the grammar must accept.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_BIT = torch.arange(32, dtype=torch.int32)  # bit i of a bitmask word is token 32 * word + i


class GrammarError(ValueError):
    """The schema cannot be compiled into a grammar."""


class Constraint:
    """One reply's grammar state (not thread-safe: one decoder drives it)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.consumed = 0
        self.gate: tuple[Tensor, float] | None = None  # see `gate_first`
        self.first_log_odds: float | None = None  # what the gate measured (bench/tool_gate.py calibrates on it)

    def gate_first(self, tokens: Tensor, log_odds: float) -> None:
        """Decide the first token's kind by probability mass: `tokens` (a bool mask [V], e.g. the
        tokens that start a tool call) are allowed first only if the base puts at least e**log_odds
        times more probability on them than on all the other allowed tokens together; else only
        those others are. Greedy decoding compares single tokens, and a call starts with one of
        three tokens while text spreads over thousands, so on its own it calls far too often."""
        self.gate = tokens, log_odds

    def restrict(self, logits: Tensor) -> Tensor:
        """`logits` [V] (float, CPU) with every token the grammar refuses next at -inf (a copy)."""
        row = self._masked(logits)
        if self.gate is not None and not self.consumed:
            tokens, log_odds = self.gate
            logp = row.log_softmax(-1)
            self.first_log_odds = float(torch.logsumexp(logp[tokens], 0) - torch.logsumexp(logp[~tokens], 0))
            row[~tokens if self.first_log_odds >= log_odds else tokens] = float("-inf")
        return row

    def _masked(self, logits: Tensor) -> Tensor:
        """The bitmask applied with plain tensor ops, not llguidance's torch.compile'd kernel: its
        generated OpenMP code next to llama.cpp's (engine.llamacpp) in one process masked every
        token or crashed the process (one torch thread; "double free or corruption")."""
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        bits = (self.bitmask[0, :, None] >> _BIT) & 1
        allowed = bits.reshape(-1)[:logits.shape[-1]].bool()
        return logits.float().masked_fill(~allowed, float("-inf"))

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: {self.matcher.get_error()}")
        self.consumed += 1

    def allowed(self) -> Tensor:
        """A bool mask [V] of the tokens the grammar allows next."""
        return torch.isfinite(self._masked(torch.zeros(self.vocab_size)))

    def forced(self) -> list[int]:
        """The tokens the grammar allows no alternative to from here (a key name, `", "`): a free
        draft, which the base cannot refuse."""
        return self.matcher.compute_ff_tokens()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar would accept, in order, from here (state unchanged)."""
        return self.matcher.validate_tokens(tokens)


class Grammars:
    """Compiles constraints for one model's tokenizer. The llguidance view of the vocabulary takes
    about a second to build, so it is made once, on the first constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll: llguidance.LLTokenizer | None = None

    def json(self, schema: dict | None) -> Constraint:
        """Any JSON object (`schema` None), or one matching `schema`."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps({**(schema or {"type": "object"}), "x-guidance": LAYOUT}))
        except (ValueError, TypeError, RuntimeError) as err:
            raise GrammarError(f"the JSON schema cannot be used: {err}") from None
        return self._constraint(grammar, "the JSON schema")

    def lark(self, text: str) -> Constraint:
        """A grammar in llguidance's Lark (engine.tools writes the tool-call one)."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except (ValueError, TypeError, RuntimeError) as err:
            raise GrammarError(f"the tools' schemas cannot be used: {err}") from None
        return self._constraint(grammar, "the tools' schemas")

    def _constraint(self, grammar: str, what: str) -> Constraint:
        if self._ll is None:
            self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self.tokenizer.turn_end_id)
        matcher = llguidance.LLMatcher(self._ll, grammar)
        if matcher.is_error():
            raise GrammarError(f"{what} cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)
