"""The forward on llama.cpp's kernels (ggml): the GGUF stays low-bit and memory-mapped.

A CPU decoding step is bound by reading weights. PyTorch can only multiply the packaged GGUF
after dequantising it (2.5x the bytes as fp16, 4x as fp32); ggml multiplies the quantised blocks
directly, dequantising in registers. This module runs our decoders (`engine.decode`) on
llama.cpp's C API, reached through llama-cpp-python's low-level bindings: one context whose
unified KV cache holds every conversation as a sequence, one `llama_decode` per batched step.

Which kernels: ggml's CPU backend comes in variants (x64, haswell = AVX2, skylakex = AVX-512, zen4
= AVX-512 with VNNI and BF16, sapphirerapids = zen4's plus AMX tiles; ./dev builds them), and
`bindings()` loads the one that scores this CPU best, so one install runs every CPU class's own
kernels (`cpu_variant()`, on /healthz). On an AMX Xeon the weights go to ggml's AMX buffer: a
prefill or a batch of rows runs on the tiles, 2.1-2.9x faster than zen4's kernels on 2 cores, while
a one-row step keeps AVX-512 VNNI.

Verify runs here too: a forward's drafted chain goes through the same `llama_decode` as causal
rows after the clean token, with logits for every row; their cells stay scratch past
`state.ids` and are dropped before the next step unless verify keeps them. A draft head reads
ggml's states (`read_states`: the embeddings output, after the final norm; heads trained on them
say `states = "normed"`). But `mode = "diffusion"` decodes AR on these kernels
(`LlamaCppModel.draft_rows`, `engine.stream.decide`), by measurement (BENCHMARKS.md, "Drafted rows
on llama.cpp's kernels", "The 1.5B's draft head"; bench/llamacpp_rows.py, bench/engines.py):
- a drafted block costs 1.5-1.9x a one-row step on AMX tiles (2, 4 or 8 rows; Q8_0 the cheapest)
  and 2x or more elsewhere on 2 cores, and the 1.5B's head (accepted for 1.4-1.6 tokens a
  forward) takes 15-34 ms to draft: verify ran at 0.72-0.86x AR's tokens/s; prompt lookup is
  accepted far less on spoken replies;
- ggml's batched kernels round a drafted row a little differently from the one-row kernel (a
  lone row over 512+ cached positions takes a split-KV attention kernel, 64+ rows a tiled one),
  so greedy verify equals greedy AR on most replies, not all: measured, not promised
  (tests/test_llamacpp.py states the tolerance).

What a `Forward` needs and how it maps: the conversation's cache is a sequence id (`Slot`); rows
past `state.ids` (an old turn's tail, rejected drafted rows) are removed from the sequence before
the next step writes there; the outputs are the last clean row and the drafted rows (their
logits). A fork (the shared system prompt of a batch of replies) is `llama_memory_seq_cp`, which in
a unified cache shares cells instead of copying.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from engine.runtime import CacheState, ContextOverflow, Forward, Interrupted

log = logging.getLogger("engine.llamacpp")

SEQUENCES = 64  # conversations whose caches are alive at once (llama.cpp allows up to 256)
BATCH = 512  # tokens per llama_decode call; a longer prefill is decoded in several calls
IDLE_EVICT_S = 30.0  # a cache unused this long may be dropped when the shared cache is full
# why `mode = "diffusion"` decodes AR on these kernels (`LlamaCppModel.draft_rows`, engine.stream.decide),
# by CPU class, from bench/llamacpp_rows.py, bench/engines.py and BENCHMARKS.md ("Drafted rows on
# llama.cpp's kernels", "AMX tiles", "The 1.5B's draft head")
NO_HEAD = "this model has no draft head trained on ggml's states, and prompt lookup alone does not pay"
DRAFT_ROWS = "on llama.cpp's kernels a drafted block of 4 costs 2x a step or more on 2 cores"
DRAFT_ROWS_AMX = "on llama.cpp's AMX tiles a drafted block of 3-4 costs 1.5-1.9x a step on 2 cores"
# CPU variants whose rows are cheap enough for a head's accepted tokens (measured with the 1.5B's
# head: none yet) and, elsewhere, what the head would need
DRAFTING_PAYS: tuple[str, ...] = ()
HEAD_TOO_DEAR = ("its draft head is accepted for 1.3-1.6 tokens a forward and takes 15-34 ms to draft, so verify "
                 "ran at 0.65-0.86x AR's tokens/s (it would need over 2.1 tokens a forward)")
# a head on several layers (engine draft --data --layers-read): the figure its training measured
LAYER_HEAD_TOO_WEAK = ("its draft head on layers {layers} decoded {tau:.2f} tokens a verify forward on held-out "
                       "replies after training on {replies} replies (it would need over 2.1 tokens a forward)")

FTYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15, "iq4_nl": 25}  # llama_ftype


def requantised(src: Path, quant: str, threads: int = 2, log_to: Callable[[str], object] = log.info) -> Path:
    """`src` re-quantised to `quant` by llama.cpp (`llama_model_quantize`), written once into the
    model cache (`requant/`, keyed by the source's name and size)."""
    from engine.common.packages import cache_dir
    dst = cache_dir() / "requant" / f"{src.stem}-{src.stat().st_size}.{quant}.gguf"
    if not dst.exists():
        lib = bindings()
        dst.parent.mkdir(parents=True, exist_ok=True)
        params = lib.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.allow_requantize = FTYPES[quant], threads, True
        tmp = dst.with_suffix(".part")
        log_to(f"re-quantising {src.name} to {quant} for this CPU's kernels (once) ...")
        start = time.perf_counter()
        if lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not re-quantise {src} to {quant}")
        tmp.rename(dst)
        log_to(f"{dst.name} written in {time.perf_counter() - start:.0f} s")
    return dst


def available() -> str:
    """'' if llama.cpp's bindings load here, else why not."""
    try:
        bindings()
    except (ImportError, OSError, RuntimeError) as err:
        return f"llama.cpp is unavailable ({type(err).__name__}: {err}); install llama-cpp-python (./dev setup)"
    return ""


_lib = None
_log_callback = None
_variant = ""


@functools.cache
def _stop_check() -> Any:
    """llama.cpp's abort callback for `LlamaCppModel.interrupt`. ggml asks it after every node of a
    forward's graph (~900 a step of the 1.5B), on a compute thread: a Python callback would take the
    GIL each time and wait for whoever holds it. The C library's strlen reads the flag instead: over a
    2-byte buffer it returns 0 (go on) or 1 (stop), which is what a C `bool (*)(void *)` returns in
    the same register."""
    return ctypes.cast(ctypes.CDLL(None).strlen, bindings().ggml_abort_callback)


# what llama.cpp logs (as errors) for a step its abort callback stopped: GGML_STATUS_ABORTED is 1
ABORTED_LINES = ("failed with error 1", "compute status: 1", "failed to decode, ret = 2")


def bindings() -> Any:  # llama_cpp.llama_cpp, a ctypes module (untyped)
    """llama-cpp-python's ctypes module, initialised once: the best CPU variant of ggml loaded for
    this CPU (`cpu_variant`), llama.cpp's warnings routed to our log."""
    global _lib, _log_callback, _variant
    if _lib is None:
        from llama_cpp import llama_cpp as lib

        @lib.llama_log_callback
        def forward_log(level: int, text: bytes, _user: object) -> None:
            line = text.decode("utf-8", "replace").rstrip()
            if line.endswith(ABORTED_LINES) or "removing memory module entries" in line:
                log.debug("%s", line)  # a step stopped by `interrupt()`, its rows undone: as asked
            elif level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
                log.log(logging.WARNING if level == 3 else logging.ERROR, "%s", line)

        _log_callback = forward_log  # a ctypes callback must outlive every call into the library
        lib.llama_log_set(forward_log, ctypes.c_void_p(0))
        _variant = _load_cpu_backend(library_dir())
        lib.llama_backend_init()  # loads ggml's backends itself only where none is loaded yet
        _lib = lib
    return _lib


def library_dir() -> Path:
    """Where llama-cpp-python keeps llama.cpp's shared libraries (and ggml's CPU variants)."""
    import llama_cpp
    return Path(llama_cpp.__file__).parent / "lib"


def cpu_variant() -> str:
    """The ggml CPU variant running here (e.g. 'haswell', 'zen4', 'sapphirerapids'), or 'built in'
    for a llama.cpp compiled for one CPU class."""
    bindings()
    return _variant


def best_cpu_variant(lib_dir: Path) -> Path | None:
    """The best of the CPU variants a dynamic-backend build ships (`libggml-cpu-*.so`, built with
    GGML_BACKEND_DL and GGML_CPU_ALL_VARIANTS: ./dev) by each variant's own score of this CPU (0: it
    cannot run here), or the one `GGML_CPU_VARIANT` names (to test another class's kernels); None
    for a build with the CPU backend built in. llama.cpp's libraries must be loaded (import
    llama_cpp): a variant links libggml-base by name."""
    variants = {p.name[len("libggml-cpu-"):].split(".")[0]: p for p in lib_dir.glob("libggml-cpu-*.so")}
    if not variants:
        return None
    forced = os.environ.get("GGML_CPU_VARIANT", "")
    if forced:
        if forced not in variants:
            raise RuntimeError(f"GGML_CPU_VARIANT={forced!r} is not one of this build's: {', '.join(sorted(variants))}")
        return variants[forced]
    scores = {name: ctypes.CDLL(str(path)).ggml_backend_score() for name, path in variants.items()}
    best = max(scores, key=lambda name: scores[name])
    if scores[best] <= 0:
        raise RuntimeError(f"none of llama.cpp's CPU variants runs on this CPU ({', '.join(sorted(variants))})")
    return variants[best]


def backend_env() -> dict[str, str]:
    """What another process using this llama-cpp-python needs in its environment to find its CPU
    kernels (llama.cpp's own server: ggml looks beside the executable, in the current directory and
    in GGML_BACKEND_PATH only)."""
    bindings()
    path = best_cpu_variant(library_dir())
    return {"GGML_BACKEND_PATH": str(path)} if path is not None else {}


def _load_cpu_backend(lib_dir: Path) -> str:
    """Load `best_cpu_variant` into the ggml that libllama links; its name ('built in' for a
    single-class build). llama-cpp-python never loads the variants itself."""
    path = best_cpu_variant(lib_dir)
    if path is None:
        return "built in"
    # the copy of ggml that libllama links (its soname: a wheel holds each name as a separate file,
    # and a second copy would keep a registry of its own)
    ggml = ctypes.CDLL(str(next(p for p in (lib_dir / "libggml.so.0", lib_dir / "libggml.so") if p.exists())))
    ggml.ggml_backend_load.argtypes, ggml.ggml_backend_load.restype = [ctypes.c_char_p], ctypes.c_void_p
    if not ggml.ggml_backend_load(str(path).encode()):
        raise RuntimeError(f"ggml could not load its CPU variant {path}")
    return path.name[len("libggml-cpu-"):].split(".")[0]


def system_info() -> str:
    """The kernels llama.cpp runs here: the CPU variant and its features (e.g. 'haswell; CPU : SSE3 = 1 | ...')."""
    return f"{cpu_variant()}; {bindings().llama_print_system_info().decode()}"


class LayerTap:
    """Reads chosen layers' outputs (ggml's `l_out-N` tensors) during each llama_decode through
    ggml's eval callback (`cb_eval`, a context parameter): what an EAGLE-3/DFlash-style drafter
    reads of the base, in the same forward that verifies. The scheduler asks the callback about
    every node of the graph (~900 a step of the 1.5B) and computes up to each node it wants before
    handing it over, so the cost is a Python call a node plus a few cut points
    (bench/layer_taps.py measures it). The last layer keeps only the rows that output logits
    (llama.cpp drops the others before its last feed-forward); earlier layers have every row."""

    NE = 16  # offset of `int64_t ne[4]` in struct ggml_tensor (after `type` and `buffer`)

    def __init__(self, layers: tuple[int, ...], n_layer: int) -> None:
        self.layers, self.n_layer = layers, n_layer
        self._names = {f"l_out-{layer}".encode(): k for k, layer in enumerate(layers)}
        self.parts: list[list[np.ndarray]] = [[] for _ in layers]
        ggml = ctypes.CDLL(str(next(p for p in (library_dir() / "libggml-base.so.0", library_dir() / "libggml-base.so")
                                    if p.exists())))
        ggml.ggml_get_name.argtypes, ggml.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        ggml.ggml_get_data.argtypes, ggml.ggml_get_data.restype = [ctypes.c_void_p], ctypes.c_void_p
        self._name, self._data = ggml.ggml_get_name, ggml.ggml_get_data
        self.callback = bindings().ggml_backend_sched_eval_callback(self._eval)  # must outlive the context

    def _eval(self, tensor: int, ask: bool, _user: object) -> bool:
        k = self._names.get(self._name(tensor))
        if ask:
            return k is not None
        if k is not None:
            cols, rows = (ctypes.c_int64.from_address(tensor + self.NE + 8 * i).value for i in range(2))
            data = (ctypes.c_float * (rows * cols)).from_address(self._data(tensor))
            self.parts[k].append(np.ctypeslib.as_array(data).reshape(rows, cols).copy())
        return True  # go on computing

    def clear(self) -> None:
        for parts in self.parts:
            parts.clear()

    def take(self, outputs: list[int]) -> Tensor:
        """The tapped rows of the calls since `clear`, at the rows flagged for output (`outputs`:
        their indices among all the calls' rows), as [outputs, len(layers) * dim]."""
        picked = []
        for layer, parts in zip(self.layers, self.parts):
            whole = np.concatenate(parts)
            picked.append(whole if layer == self.n_layer - 1 else whole[outputs])  # the last has only those
        self.clear()
        return torch.from_numpy(np.concatenate(picked, axis=1))


@dataclass
class Args:
    """What the decoders and the engine read of a model (`Transformer.args`'s subset)."""

    dim: int
    vocab_size: int
    max_seq_len: int


class Slot:
    """One conversation's sequence in the shared KV cache. It is given back when its `CacheState`
    is collected, and may lose its cells (and the state its tokens) after sitting idle while the
    cache is full (`LlamaCppModel._evict`)."""

    def __init__(self, model: "LlamaCppModel", capacity: int, state: CacheState) -> None:
        self.model, self.capacity = model, capacity
        self.seq: int | None = None
        self.cells = 0  # positions written to the sequence
        self.last_used = time.monotonic()
        self.state = weakref.ref(state)

    def forget(self) -> None:
        self.model.forget(self)


def _slot_of(state: CacheState) -> Slot:
    """A state's slot: `LlamaCppModel.open_cache` gave it one."""
    assert state.slot is not None
    return cast(Slot, state.slot)


class LlamaCppModel:
    """A GGUF on llama.cpp: the `model` of a `LoadedModel` loaded with `quantize="gguf"`."""

    mask_blocks = False  # a batch's rows are causal within their sequence: drafted chains only

    def __init__(self, path: Path, max_seq_len: int, layers: tuple[int, ...] = ()) -> None:
        """`layers`: the base layers whose outputs each step's states are (`LayerTap`, for a drafter
        that reads several); () = the final normed state (llama.cpp's embeddings output)."""
        lib = bindings()
        self.path = Path(path)
        # CPU threads for the next step, asked per step: the voice service gives the LM both cores
        # while no speech recognition or synthesis is waiting for one (voice.pipeline.lm.LocalLM)
        self.threads: Callable[[], int] = torch.get_num_threads
        params = lib.llama_model_default_params()
        params.use_mmap = True  # the weights stay in the page cache as packaged, shared between processes
        start = time.perf_counter()
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path}")
        trained = lib.llama_model_n_ctx_train(self._model)
        self.args = Args(lib.llama_model_n_embd(self._model),
                         lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)),
                         min(max_seq_len, trained) if trained > 0 else max_seq_len)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = 4 * self.args.max_seq_len  # room for a few whole conversations; idle ones are evicted
        cparams.n_batch = cparams.n_ubatch = BATCH
        cparams.n_seq_max = SEQUENCES
        cparams.kv_unified = True  # conversations share the cells: a forked prefix costs nothing
        cparams.n_threads = cparams.n_threads_batch = self.threads()
        self.layers = tuple(layers)
        self._tap = LayerTap(self.layers, lib.llama_model_n_layer(self._model)) if layers else None
        if self._tap is not None:
            cparams.cb_eval = self._tap.callback
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not make a context of {cparams.n_ctx} tokens for {path}")
        # a draft head's inputs (`attach_head`, `read_states`): none until one is attached
        self.embed_tokens: nn.Module | None = None
        self._embed: Callable[[], nn.Module] | None = None
        self.head_window = self.state_rows = 0
        self.head_note = HEAD_TOO_DEAR  # what the attached head's figures say (`attach_head`)
        self.state_dim = self.args.dim * max(1, len(layers))  # a state row: one base state, or each tapped layer's
        self.kv_tokens = lib.llama_n_ctx(self._ctx)
        self._mem = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(BATCH, 0, 1)
        self._free_seqs = list(range(SEQUENCES - 1, -1, -1))
        self._slots: set[Slot] = set()
        self._lock = threading.Lock()  # slots are given back from any thread (garbage collection)
        # `interrupt()`: [0] = 1 stops the llama_decode running now, if it was begun interruptible
        self._stop = ctypes.create_string_buffer(2)
        self._stop_lock = threading.Lock()
        self._interruptible = False
        lib.llama_set_abort_callback(self._ctx, _stop_check(), ctypes.cast(self._stop, ctypes.c_void_p))
        self._lib = lib
        log.info("llama.cpp: %s in %.1f s, KV cache of %d tokens; %s", self.path.name,
                 time.perf_counter() - start, self.kv_tokens, system_info())

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is not None:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            lib.llama_model_free(self._model)

    @property
    def draft_rows(self) -> str:
        """Why verify's drafted rows do not pay here ('' where they do): a head must read ggml's
        states, and this CPU class's rows must be cheap enough for what it gets accepted."""
        rows = DRAFT_ROWS_AMX if cpu_variant() == "sapphirerapids" else DRAFT_ROWS
        if not self.head_window:
            return f"{rows}, and {NO_HEAD}"
        return "" if cpu_variant() in DRAFTING_PAYS else f"{rows}: {self.head_note}"

    def attach_head(self, window: int, embed: Callable[[], nn.Module], note: str = "") -> None:
        """A draft head reads the states of the last `window` positions and the tokens after them
        (`embed()` makes that token table; reading it from the GGUF takes seconds, so only once
        states are read); the states are read only where drafting pays here (`read_states`).
        `note`: what the head's own figures say, for the decision's why (default: the shipped head's)."""
        self.head_window, self._embed = window, embed
        self.head_note = note or HEAD_TOO_DEAR
        self.read_states(window if not self.draft_rows else 0)

    def read_states(self, rows: int) -> None:
        """From now on each step also gives the hidden states of its last `rows` clean rows and of
        every drafted row (after the final norm: ggml's embeddings output), zeros for earlier rows,
        and each cache keeps them (`CacheState.hidden`): what a draft head reads. Only those rows:
        llama.cpp outputs (and runs the LM head on) every row of a call that asks for embeddings, so
        a prefill's earlier rows go in a call of their own without."""
        self.state_rows = rows
        if rows and self._embed is not None and self.embed_tokens is None:
            self.embed_tokens = self._embed()
        self._lib.llama_set_embeddings(self._ctx, False)

    # --- conversation caches ------------------------------------------------------------------

    def open_cache(self, state: CacheState, capacity: int | None) -> None:
        """A sequence for `state` (a CacheState) in the shared cache, given back when `state` is collected."""
        slot = Slot(self, min(capacity or self.args.max_seq_len, self.args.max_seq_len), state)
        if self.state_rows:
            state.hidden = torch.zeros(slot.capacity, self.state_dim, dtype=torch.float16)
        weakref.finalize(state, self._release, slot)
        with self._lock:
            self._slots.add(slot)
        state.slot = slot

    def copy_cache(self, src: CacheState, dst: CacheState, n: int) -> None:
        """`dst`'s sequence starts with `src`'s first `n` positions (shared cells, no copy)."""
        src_slot, dst_slot = _slot_of(src), _slot_of(dst)
        with self._lock:
            self._seq_for(dst_slot, in_use={src_slot})
            self._lib.llama_memory_seq_rm(self._mem, dst_slot.seq, -1, -1)
            if n:
                self._lib.llama_memory_seq_cp(self._mem, src_slot.seq, dst_slot.seq, 0, n)
            dst_slot.cells = n
        if src.hidden is not None and dst.hidden is not None:
            dst.hidden[:n] = src.hidden[:n]

    def _release(self, slot: Slot) -> None:
        with self._lock:
            self._slots.discard(slot)
            self._drop(slot)

    def _drop(self, slot: Slot) -> None:
        """Free a slot's cells and sequence id (the caller holds the lock)."""
        if slot.seq is not None:
            self._lib.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
            self._free_seqs.append(slot.seq)
            slot.seq, slot.cells = None, 0

    def forget(self, slot: Slot) -> None:
        """Drop every cell of the slot (its state was cleared)."""
        with self._lock:
            self._drop(slot)

    def _seq_for(self, slot: Slot, in_use: set[Slot]) -> int:
        """The slot's sequence id, taking a free one (or an idle slot's) if it has none."""
        if slot.seq is None:
            if not self._free_seqs:
                self._evict(in_use | {slot}, enough=lambda: bool(self._free_seqs))
            slot.seq = self._free_seqs.pop()
        return slot.seq

    def _evict(self, in_use: set[Slot], enough: Callable[[], bool]) -> None:
        """Drop the caches of the slots idle longest (at least IDLE_EVICT_S: a reply being decoded
        is never idle that long) until `enough()`; their states forget their tokens, so their next
        turn prefills again."""
        now = time.monotonic()
        idle = sorted((s for s in self._slots if s not in in_use and s.seq is not None
                       and now - s.last_used >= IDLE_EVICT_S), key=lambda s: s.last_used)
        for slot in idle:
            if enough():
                return
            state = slot.state()
            if state is not None:
                state.ids.clear()
                state.blocks.clear()
            self._drop(slot)
        if not enough():
            raise ContextOverflow(f"the LM's cache is full ({self.kv_tokens} tokens, {len(self._slots)} conversations, "
                                  "none idle): serve fewer sessions or give [lm] max_seq_len more room")

    def _make_room(self, forwards: list[Forward]) -> None:
        """Cells past each state's cached tokens are stale: drop them; then make sure the step's
        new rows fit in the shared cache."""
        in_use = {_slot_of(f.state) for f in forwards}
        for f in forwards:
            slot, keep = _slot_of(f.state), len(f.state.ids)
            self._seq_for(slot, in_use)
            if slot.cells > keep:
                self._lib.llama_memory_seq_rm(self._mem, slot.seq, keep, -1)
                slot.cells = keep
        needed = sum(len(f.clean) + len(f.draft) for f in forwards)
        self._evict(in_use, enough=lambda: sum(s.cells for s in self._slots) + needed <= self.kv_tokens)

    # --- the forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, forwards: list[Forward], interruptible: bool = False) -> list[tuple[Tensor, Tensor | None]]:
        """Each forward's clean tokens, then its drafted tokens as causal rows (verify), through
        llama_decode (batched; a long prefill in several calls); per forward: the logits of its last
        clean row and of every drafted row [rows, vocab], and its rows' hidden states where
        `read_states` asks for them (else None). Drafted rows are written to the cache past
        `state.ids`: scratch, dropped before the next step unless verify keeps them.
        `interruptible`: a step of one llama_decode call that `interrupt()` stops raises
        `Interrupted`; llama.cpp then removes the rows it wrote, so the caches are as before."""
        rows: list[tuple[int, int, int, bool]] = []  # (forward, token, position, output)
        outputs: list[int] = []  # per forward
        for i, f in enumerate(forwards):
            if f.parents is not None or (f.draft and not f.draft_causal):
                raise ValueError("llama.cpp runs drafted chains as causal rows (verify); draft trees and "
                                 "mask-denoising blocks need the PyTorch model (quantize none|fp16|int8)")
            start, n = len(f.state.ids), len(f.clean) + len(f.draft)
            if start + n > f.state.capacity:
                raise ContextOverflow(f"conversation needs {start + n} tokens but the context holds {f.state.capacity}")
            first_out = max(0, len(f.clean) - max(1, self.state_rows))
            rows += [(i, token, start + j, j >= first_out) for j, token in enumerate(f.clean + f.draft)]
            outputs.append(n - first_out)
        with self._lock:
            self._make_room(forwards)
            # _make_room gave each a sequence
            logits, hidden = self._decode(rows, [cast(int, _slot_of(f.state).seq) for f in forwards],
                                          interruptible and len(rows) <= BATCH)
            for f in forwards:
                slot = _slot_of(f.state)
                slot.cells = len(f.state.ids) + len(f.clean) + len(f.draft)
                slot.last_used = time.monotonic()
        out: list[tuple[Tensor, Tensor | None]] = []
        at = 0
        for f, m in zip(forwards, outputs):
            n = len(f.draft) + (1 if f.clean else 0)
            states = None
            if hidden is not None:
                states = torch.zeros(len(f.clean) + len(f.draft), self.state_dim)
                states[len(states) - m:] = hidden[at:at + m]
            out.append((logits[at + m - n:at + m], states))
            at += m
        return out

    def interrupt(self) -> None:
        with self._stop_lock:
            if self._interruptible:
                self._stop[0] = b"\x01"

    def _decode(self, rows: list[tuple[int, int, int, bool]], seqs: list[int], interruptible: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """llama_decode over `rows`: the output rows' logits, in order, and their hidden states where
        `read_states` asks for them (rows that need none go first, in calls without embeddings)."""
        threads = self.threads()
        self._lib.llama_set_n_threads(self._ctx, threads, threads)
        if not self.state_rows:
            return self._decode_calls(rows, seqs, False, interruptible)
        if self._tap is not None:  # the tapped layers' rows come with the logits: one call, no embeddings
            self._tap.clear()
            logits, _ = self._decode_calls(rows, seqs, False, interruptible)
            return logits, self._tap.take([j for j, row in enumerate(rows) if row[3]])
        self._decode_calls([row for row in rows if not row[3]], seqs, False)
        self._lib.llama_set_embeddings(self._ctx, True)
        try:
            return self._decode_calls([row for row in rows if row[3]], seqs, True)
        finally:
            self._lib.llama_set_embeddings(self._ctx, False)

    def _decode_calls(self, rows: list[tuple[int, int, int, bool]], seqs: list[int], states: bool,
                      interruptible: bool = False) -> tuple[Tensor, Tensor | None]:
        """llama_decode over `rows` in calls of at most BATCH (`interruptible`: one call)."""
        lib, batch, vocab, dim = self._lib, self._batch, self.args.vocab_size, self.args.dim
        logits, hidden = [torch.empty(0, vocab)], [torch.empty(0, dim)]
        for start in range(0, len(rows), BATCH):
            chunk = rows[start:start + BATCH]
            for j, (i, token, pos, output) in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.logits[j] = token, pos, output
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seqs[i]
            batch.n_tokens = len(chunk)
            with self._stop_lock:
                self._stop[0], self._interruptible = b"\x00", interruptible
            try:
                status = lib.llama_decode(self._ctx, batch)
            finally:
                with self._stop_lock:
                    self._stop[0], self._interruptible = b"\x00", False
            if status == 2:  # GGML_STATUS_ABORTED: llama.cpp removed what the call wrote
                raise Interrupted(f"a step of {len(chunk)} rows was interrupted")
            if status != 0:
                raise RuntimeError(f"llama_decode failed ({status}) on {len(chunk)} tokens")
            outputs = sum(row[3] for row in chunk)
            if outputs:
                logits.append(torch.from_numpy(np.ctypeslib.as_array(lib.llama_get_logits(self._ctx),
                                                                     shape=(outputs, vocab)).copy()))
            if outputs and states:
                hidden.append(torch.from_numpy(np.ctypeslib.as_array(lib.llama_get_embeddings(self._ctx),
                                                                     shape=(outputs, dim)).copy()))
        return torch.cat(logits), torch.cat(hidden) if states else None
