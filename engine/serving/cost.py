"""What a prompt token costs to read on this machine, learnt from the scheduler's forwards: the
scheduler sizes its prefill chunks by it, admission refuses a prompt that cannot be read in time."""

from __future__ import annotations

from dataclasses import dataclass

MIN_PREFILL_CHUNK = 16  # tokens: smaller chunks lose more throughput than they give back in latency


@dataclass
class PrefillCost:
    token_s: float | None = None  # model time per prompt token lately, measured on prefill forwards
    best_token_s: float | None = None  # ... and the least it took (the machine to itself)
    best_slice_token_s: float | None = None  # ... the least in chunks of about a slice

    def learn(self, tokens: int, took: float, slice_tokens: int) -> None:
        """A forward of `tokens` rows took `took` s; one of at most twice `slice_tokens` rows is a
        slice's worth: the rate of a prompt read beside others."""
        if tokens < MIN_PREFILL_CHUNK:
            return
        sample = took / tokens
        if tokens <= 2 * slice_tokens:
            self.best_slice_token_s = min(sample, self.best_slice_token_s or sample)
        self.token_s = sample if self.token_s is None else 0.7 * self.token_s + 0.3 * sample
        self.best_token_s = min(sample, self.best_token_s or sample)

    def prefill_s(self, tokens: int, sliced: bool = False) -> float | None:
        """The least that prefilling `tokens` new prompt tokens takes here, in big chunks or a slice
        at a time (`sliced`: ~1.4x the cost a token on two Zen 5 cores); None: not measured yet."""
        best = self.best_slice_token_s if sliced and self.best_slice_token_s is not None else self.best_token_s
        return None if best is None else tokens * best
