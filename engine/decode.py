"""Decoders over one model (`engine.runtime.Model`): autoregressive and block diffusion, as plain generators.

All share `run`, the one forward used everywhere: it appends *clean* tokens (prompt or a
finished block) to the KV cache with the checkpoint's context pattern and, in the same
forward, lets an optional *draft block* (mask tokens being denoised) look at everything
before it plus its own whole block. Fusing the write of block k with the first denoising
step of block k+1 means a block costs only its denoising steps, and the prompt prefill
doubles as the first step of the first block: that is what keeps time-to-first-block low.

The default commit rule is `verify` (lossless): a drafter (`engine.draft`) proposes the next
block, the block runs as *causal* rows of the base model in the forward that also writes the
previous step's last token, and the longest prefix that agrees with the base model's own
choice at each row is committed, plus the base's own next token. Greedy replies are token for
token the AR replies; sampled ones keep the base's distribution (speculative sampling). Greedy
decoding can also check a draft *tree* (`draft_tree`): alternatives for the same positions in one
forward, the longest path the base agrees with committed (`verify_tree`). The
`threshold` and `topk` rules denoise mask blocks with a diffusion-trained checkpoint (an
adapter or a native diffusion LM) and are lossy.

Cache invariant: `state.ids` are exactly the tokens whose cache rows are final. Anything
past them is scratch, so stopping between any two forwards (barge-in) leaves a state the
next turn can extend; the last finished block simply rides in with the next turn's prefill.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.draft import Drafter, LookupDrafter, Proposal, TreeDrafter
from engine.grammar import Constraint
from engine.model import settle
from engine.runtime import CacheState, ContextOverflow, Forward, Model
from engine.sampling import tempered


@dataclass
class DiffusionSpec:
    """What a checkpoint says about its own diffusion training (read by `engine.loading`)."""

    mask_id: int
    block_size: int = 4
    shift: bool = True  # logits at i predict token i+1 (Fast-dLLM v2 token shift)
    context: str = "causal"  # how committed tokens attend: causal | block_causal | bidirectional
    sub_block_size: int = 0  # Fast-dLLM v2 denoises 32-token blocks in sub-blocks of 8
    trained: bool = False  # False: an AR checkpoint; the diffusion decoder runs but gains nothing


@dataclass
class DecodeConfig:
    mode: str = "diffusion"  # diffusion | ar
    max_new_tokens: int = 96
    temperature: float = 0.0  # 0: greedy
    block_size: int = 0  # verify: tokens drafted per forward; threshold/topk: mask block; 0: the drafter's/checkpoint's
    first_block_size: int = 0  # 0: same as block_size; smaller = earlier first words
    rule: str = "verify"  # verify (lossless, drafted blocks checked by the base) | threshold | topk (lossy)
    threshold: float = 0.9
    topk: int = 1
    # verify: send the drafted prefix the drafter gives at least this chance of being all right
    draft_threshold: float = 0.5
    # verify, greedy, chained heads: draft a tree of this many tokens instead of a chain (0: a chain)
    draft_tree: int = 0
    max_steps: int = 0  # per block; 0 = block size (the last step commits whatever is left)
    release_prefix: bool = True  # hand out a block's finished left part before the block is done
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("diffusion", "ar"):
            raise ValueError(f"mode must be 'diffusion' or 'ar', not {self.mode!r}")
        if self.rule not in COMMIT_RULES:
            raise ValueError(f"rule must be one of {sorted(COMMIT_RULES)}, not {self.rule!r}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")


@dataclass
class Block:
    """The token ids one decoder step commits (a whole block, or its finished left part; one token
    under AR): a decoder's unit. What callers get is text: `engine.stream.Piece`, made from these."""

    token_ids: list[int]
    steps: int  # forwards spent on the block so far
    forwards: int  # forwards since the request started (prefill included)
    done: bool  # the reply is finished (EOS or token budget)
    t: float = field(default_factory=time.perf_counter)




# --- commit rules ------------------------------------------------------------------------------

def verify_rule(target: Tensor, proposal: Proposal, temperature: float,
                generator: torch.Generator | None, constraint: Constraint | None = None) -> list[int]:
    """Lossless: the tokens to commit after a verify forward. `target` [k + 1, V] are the base's
    logits at the row before each drafted token and at the last one. Greedy: the drafted prefix
    the base agrees with, then the base's own next token. Sampled (speculative sampling): drafted
    token d is kept with probability min(1, p(d) / q(d)), else replaced by a draw from
    max(p - q, 0), which leaves every committed token distributed exactly as the base's p.
    With a `constraint` each row's p is the base's under the grammar, taken after the tokens
    committed before it (which it consumes): the same rule, for the constrained distribution."""
    drafted = proposal.ids
    if constraint is None and temperature <= 0:
        best = target.argmax(-1).tolist()
        n = 0
        while n < len(drafted) and drafted[n] == best[n]:
            n += 1
        return drafted[:n] + [best[n]]
    out: list[int] = []
    for j in range(len(drafted) + 1):
        row = target[j].float().cpu()  # the generator is a CPU one
        if constraint is not None:
            row = constraint.restrict(row)
        if temperature <= 0:
            token = int(row.argmax())
        else:
            p = tempered(row, temperature)
            token = int(torch.multinomial(p, 1, generator=generator))  # the base's own next token
            if j < len(drafted):
                d = drafted[j]
                q = proposal.probs[j].cpu() if proposal.probs is not None else F.one_hot(torch.tensor(d),
                                                                                            p.shape[-1]).float()
                if float(torch.rand(1, generator=generator)) * q[d] <= p[d]:
                    token = d
                else:
                    residual = (p - q).clamp(min=0)
                    token = int(torch.multinomial(residual if residual.sum() > 0 else p, 1, generator=generator))
        if constraint is not None:
            constraint.consume(token)
        out.append(token)
        if j == len(drafted) or token != drafted[j]:
            return out
    return out


def verify_tree(target: Tensor, proposal: Proposal) -> tuple[list[int], list[int]]:
    """Greedy, lossless: (tokens to commit, indices of the drafted ones among them) after a tree
    forward. `target` [1 + len(ids), V]: the base's logits after the last committed token, then
    after each drafted token. From the root, follow the child that is the base's own choice while
    there is one; then commit the base's next token."""
    assert proposal.parents is not None  # a tree
    best = target.argmax(-1).tolist()
    committed: list[int] = []
    path: list[int] = []
    at = -1
    while True:
        token = best[at + 1]
        committed.append(token)
        child = next((i for i, (t, parent) in enumerate(zip(proposal.ids, proposal.parents))
                      if parent == at and t == token), None)
        if child is None:
            return committed, path
        path.append(child)
        at = child


# Mask-block rules (lossy): which masked positions become final this step.

CommitRule = Callable[[Tensor, int], Tensor]  # (confidence of masked positions, steps left) -> bool


def threshold_rule(threshold: float) -> CommitRule:
    """Fast-dLLM: commit all positions at least `threshold` sure, and always the surest one."""
    def rule(confidence: Tensor, steps_left: int) -> Tensor:
        commit = confidence >= threshold
        commit[confidence.argmax()] = True
        return commit
    return rule


def topk_rule(k: int) -> CommitRule:
    """Commit the k surest positions each step (k=1: sequential unmasking by confidence)."""
    def rule(confidence: Tensor, steps_left: int) -> Tensor:
        commit = torch.zeros_like(confidence, dtype=torch.bool)
        commit[confidence.topk(min(k, confidence.numel())).indices] = True
        return commit
    return rule


COMMIT_RULES: dict[str, Callable[[DecodeConfig], CommitRule] | None] = {
    "verify": None,  # not a mask rule: `verify_steps` applies `verify_rule`
    "threshold": lambda cfg: threshold_rule(cfg.threshold),
    "topk": lambda cfg: topk_rule(cfg.topk),
}


# --- the one forward -------------------------------------------------------------------------


@torch.inference_mode()
def run_many(model: Model, forwards: list[Forward], interruptible: bool = False
             ) -> list[tuple[Tensor | None, Tensor | None]]:
    """Run several sequences' forwards as one batched pass (`Model.step`); an `interruptible` one
    that `Model.interrupt()` stops raises `Interrupted` and commits nothing."""
    return [f.commit(logits, hidden) for f, (logits, hidden) in zip(forwards, model.step(forwards, interruptible))]


def run(model: Model, state: CacheState, clean: list[int], clean_is_block: bool,
        draft: list[int], context: str = "causal", draft_causal: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """One sequence's forward; returns (logits of the last clean row or None, of the draft rows or None)."""
    return run_many(model, [Forward(state, clean, clean_is_block, draft, context, draft_causal)])[0]


# A decoder's steps: it yields a `Forward` (and is sent its `commit` result) or a `Block` (and is sent None).
Steps = Generator["Forward | Block", Any, None]


def drive(model: Model, steps: Steps) -> Generator[Block, None, None]:
    """Run a decoder's forwards one at a time and pass its blocks on."""
    result = None
    while True:
        try:
            item = steps.send(result)
        except StopIteration:
            return
        if isinstance(item, Forward):
            result = run_many(model, [item])[0]
        else:
            result = None
            yield item


def pick(logits: Tensor, temperature: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Token and its probability per row: greedy at temperature 0, sampled otherwise."""
    if temperature <= 0:
        probs = logits.softmax(-1)
        confidence, token = probs.max(-1)
        return token, confidence
    probs = tempered(logits, temperature)
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, probs.gather(-1, token[:, None]).squeeze(-1)


# --- decoders --------------------------------------------------------------------------------

def ar_steps(state: CacheState, new_prompt: list[int], cfg: DecodeConfig, stop_ids: set[int],
             constraint: Constraint | None = None) -> Steps:
    """Greedy/sampled next-token decoding: the baseline on the same weights and cache code.

    Yields a `Forward` whenever it needs one (and is sent its logits) and a `Block` per token."""
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    pending = new_prompt
    for n in range(1, cfg.max_new_tokens + 1):
        last, _ = yield Forward(state, pending)
        if constraint is not None:
            last = constraint.restrict(last)
        token = int(pick(last[None], cfg.temperature, generator)[0])
        if constraint is not None:
            constraint.consume(token)
        done = token in stop_ids or n == cfg.max_new_tokens
        yield Block([token], 1, n, done)
        if done:
            return
        pending = [token]


MAX_FORCED_DRAFT = 16  # a draft row costs up to a third of a forward here; a forced token always saves one


def verify_steps(state: CacheState, new_prompt: list[int], cfg: DecodeConfig, drafter: Drafter,
                 embed: nn.Module | None,
                 stop_ids: set[int], constraint: Constraint | None = None) -> Steps:
    """Draft, then verify: each forward writes the last committed token and checks the drafted
    block as causal rows; `verify_rule` commits what the base agrees with plus its own next token.
    The first forward is the prompt's prefill (there is nothing to draft from yet). Rejected rows
    stay scratch past `state.ids`, so the cache invariant holds between any two forwards.

    Yields a `Forward` per step (and is sent its logits) and a `Block` per step's commits."""
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    k_max = cfg.block_size or drafter.block
    trees = (cfg.draft_tree > 0 and cfg.temperature <= 0 and constraint is None
             and getattr(drafter, "drafts_trees", False))
    pending, proposal = new_prompt, Proposal(forced_draft(constraint))
    produced = forwards = 0
    while True:
        drafted = proposal.until_unsure(cfg.draft_threshold).first(cfg.max_new_tokens - produced - 1)
        if constraint is not None:  # a drafted token the grammar refuses could never be committed
            drafted = drafted.first(constraint.valid_prefix(drafted.ids))
        k = len(drafted.ids)
        forward = Forward(state, pending, draft=drafted.ids, draft_causal=True, parents=drafted.parents)
        last, draft_logits = yield forward
        forwards += 1
        target = torch.cat([last[None], draft_logits]) if k else last[None]
        if drafted.parents is None:
            committed = verify_rule(target, drafted, cfg.temperature, generator, constraint)
            path = list(range(len(committed) - 1))  # drafted tokens the base agreed with: their rows are final
        else:
            committed, path = verify_tree(target, drafted)
        stop = next((i + 1 for i, token in enumerate(committed) if token in stop_ids), len(committed))
        committed, path = committed[:stop], path[:stop]
        if drafted.parents is not None:
            settle(forward, path)
        state.ids.extend(committed[:len(path)])
        produced += len(committed)
        done = committed[-1] in stop_ids or produced >= cfg.max_new_tokens
        yield Block(committed, 1, forwards, done)
        if done:
            return
        pending = [committed[-1]]
        proposal = Proposal(forced_draft(constraint))
        if trees:
            assert state.hidden is not None and embed is not None  # drafters read the base's hidden states and
            # embedding (PyTorch's models keep them)
            tree_drafter = cast(TreeDrafter, drafter)  # `drafts_trees` said so
            proposal = tree_drafter.propose_tree(embed, state.hidden[:len(state.ids)], state.ids + pending, k_max,
                                                 cfg.draft_tree)
        elif not proposal.ids:  # a draft head reads the base's hidden states; prompt lookup needs none
            hidden = state.hidden[:len(state.ids)] if state.hidden is not None else None
            proposal = drafter.propose(embed, hidden, state.ids + pending, k_max, cfg.temperature, generator,
                                       cfg.draft_threshold)


def forced_draft(constraint: Constraint | None) -> list[int]:
    """What the grammar forces next, drafted instead of the drafter's guess (at most MAX_FORCED_DRAFT)."""
    return constraint.forced()[:MAX_FORCED_DRAFT] if constraint is not None else []


def diffusion_steps(state: CacheState, new_prompt: list[int], cfg: DecodeConfig, spec: DiffusionSpec,
                    stop_ids: set[int]) -> Steps:
    """Block diffusion: each block starts as masks and is committed by `cfg.rule` over a few steps.

    Yields a `Forward` per denoising step (and is sent its logits) and a `Block` per release."""
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    mask_rule = COMMIT_RULES[cfg.rule]
    assert mask_rule is not None  # a mask rule: `plan` sends `verify` to `verify_steps`
    rule = mask_rule(cfg)
    block_size = cfg.block_size or spec.sub_block_size or spec.block_size
    size = min(cfg.first_block_size or block_size, cfg.max_new_tokens)
    pending, pending_is_block = new_prompt, False
    last_logits: Tensor | None = None
    produced = forwards = 0
    while True:
        draft = [spec.mask_id] * size
        masked = torch.ones(size, dtype=torch.bool)
        max_steps = cfg.max_steps or size
        steps = released = 0
        stop_at = size  # index after the last token that belongs to the reply
        while masked[:stop_at].any():
            clean_last, logits = yield Forward(state, pending, pending_is_block, list(draft), spec.context)
            forwards += 1
            steps += 1
            if pending:
                last_logits, pending = clean_last, []
            # a fresh tensor either way: `run`'s output is an inference tensor, not writable out here
            if spec.shift:
                assert last_logits is not None  # the first forward wrote the prompt
                logits = torch.cat([last_logits[None], logits[:-1]])
            else:
                logits = logits.clone()
            logits[:, spec.mask_id] = float("-inf")
            tokens, confidence = pick(logits, cfg.temperature, generator)
            idx = masked.nonzero().squeeze(-1)
            idx = idx[idx < stop_at]
            commit = (rule(confidence[idx], max_steps - steps) if steps < max_steps
                      else torch.ones_like(idx, dtype=torch.bool))
            for i in idx[commit].tolist():
                draft[i] = int(tokens[i])
                masked[i] = False
                if draft[i] in stop_ids:
                    stop_at = min(stop_at, i + 1)
            ready = int(masked[:stop_at].int().argmax()) if masked[:stop_at].any() else stop_at
            finished = ready == stop_at
            done = finished and (stop_at < size or produced + stop_at >= cfg.max_new_tokens
                                 or draft[stop_at - 1] in stop_ids)
            if ready > released and (cfg.release_prefix or finished):
                yield Block(draft[released:ready], steps, forwards, done)
                released = ready
        produced += stop_at
        if done:
            return
        pending, pending_is_block = draft[:stop_at], True
        size = min(block_size, cfg.max_new_tokens - produced)


@torch.inference_mode()
def generate_ar_batch(model: Model, prompts: list[list[int]], max_new_tokens: int,
                      stop_ids: set[int], temperature: float = 0.0,
                      generator: torch.Generator | None = None) -> list[list[int]]:
    """Many independent AR replies at once (teacher distillation, benchmarks); no conversation state
    (`ar_batch`)."""
    return ar_batch(model, prompts, max_new_tokens, stop_ids, temperature, generator)[0]


def ar_batch(model: Model, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
             temperature: float = 0.0, generator: torch.Generator | None = None
             ) -> tuple[list[list[int]], list[CacheState]]:
    """Many independent AR replies at once, and the cache state each ends with (its hidden states:
    what a draft head is trained on).

    The prefix all prompts share (the system prompt) is computed once and copied into each
    reply's own cache; every step is then one batched forward (`run_many`) over the replies
    still going, so each reply is the one decoding it alone gives, a finished reply stops
    costing anything, and no row is padding.
    """
    shared = list(os.path.commonprefix(prompts))[:min(len(p) for p in prompts) - 1]  # each keeps a new token
    root = CacheState.new(model, max(len(p) for p in prompts) + max_new_tokens)
    if shared:
        run(model, root, shared, False, [])
    states = [root.fork(model) for _ in prompts]
    pending = [p[len(shared):] for p in prompts]
    replies: list[list[int]] = [[] for _ in prompts]
    going = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        results = run_many(model, [Forward(states[i], pending[i]) for i in going])
        lasts = cast("list[Tensor]", [last for last, _ in results])  # each wrote a clean token: never None
        token, _ = pick(torch.stack(lasts), temperature, generator)
        for i, t in zip(going, token.tolist()):
            replies[i].append(t)
            pending[i] = [t]
        going = [i for i in going if replies[i][-1] not in stop_ids]
        if not going:
            break
    return replies, states


def decoder_steps(state: CacheState, new: list[int], cfg: DecodeConfig, spec: DiffusionSpec, stop_ids: set[int],
                  drafter: Drafter | None = None, embed: nn.Module | None = None,
                  constraint: Constraint | None = None) -> Steps:
    """The decoder `cfg` names, continuing `state` with the uncached tokens `new`."""
    if cfg.mode == "ar":
        return ar_steps(state, new, cfg, stop_ids, constraint)
    if cfg.rule == "verify":
        return verify_steps(state, new, cfg, drafter or LookupDrafter(), embed, stop_ids, constraint)
    if constraint is not None:
        raise ValueError(f"constrained output needs rule 'verify' or mode 'ar', not rule {cfg.rule!r}")
    return diffusion_steps(state, new, cfg, spec, stop_ids)


def prefill_steps(state: CacheState, new: list[int], chunk: Callable[[], int] | None
                  ) -> Generator[Forward, Any, list[int]]:
    """Write `new` into the cache `chunk()` tokens a forward (asked before each; None: all at
    once) and return the last stretch unwritten: the decoder's first forward writes it. A
    scheduler runs other conversations' forwards between the chunks, so a long prompt cannot hold
    the CPU for seconds."""
    while chunk is not None and 0 < (n := chunk()) < len(new):
        yield Forward(state, new[:n])
        new = new[n:]
    return new


def plan(state: CacheState, prompt: list[int], cfg: DecodeConfig, spec: DiffusionSpec,
         stop_ids: set[int], drafter: Drafter | None = None, embed: nn.Module | None = None,
         constraint: Constraint | None = None, prefill_chunk: Callable[[], int] | None = None) -> Steps:
    """The decoder's steps to continue `state` with `prompt` (the whole conversation so far);
    only the prompt's uncached tail is prefilled, `prefill_chunk()` tokens a forward (None: at once).
    `verify` drafts with `drafter` (prompt lookup when None); `embed` is the base model's token
    embedding, which a draft head reads. `constraint` (engine.grammar) keeps the reply inside a grammar."""
    if len(prompt) + cfg.max_new_tokens > state.capacity:
        raise ContextOverflow(f"prompt of {len(prompt)} tokens plus {cfg.max_new_tokens} new tokens exceeds "
                              f"the context of {state.capacity}")

    new = state.reuse_for(prompt)

    def steps() -> Steps:
        rest = yield from prefill_steps(state, new, prefill_chunk)
        yield from decoder_steps(state, rest, cfg, spec, stop_ids, drafter, embed, constraint)
    return steps()
