"""Tokenizer and chat template, from a `tokenizer.json` folder or from GGUF metadata."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers


@dataclass
class Tokenizer:
    backend: HFTokenizer
    chat_template: str
    eos_ids: set[int]
    bos_token: str = ""
    eos_token: str = ""
    special_ids: set[int] = field(default_factory=set)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def turn_end_id(self) -> int:
        """The token that ends an assistant turn (the checkpoint's own EOS, e.g. Qwen's <|im_end|>)."""
        declared = self.token_id(self.eos_token) if self.eos_token else None
        return declared if declared in self.eos_ids else min(self.eos_ids)

    @property
    def supports_tools(self) -> bool:
        """The chat template renders `tools` itself (Qwen2.5's does; SmolLM2's does not)."""
        return "tools" in self.chat_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        return _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    def encode_chat_open(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """`messages` in the template with the last one left open: its text, and not the token that
        ends it, so the model's next token says whether (and how) it would go on. The ids are a
        prefix of the whole prompt's (the template's end-of-turn is a special token, a split in BPE)."""
        if not messages:
            raise ValueError("an open prompt needs a message to leave open")
        mark = "\x00open\x00"  # text no message holds: where the last message's content ends
        last = {**messages[-1], "content": messages[-1]["content"] + mark}
        rendered = self.render_chat([*messages[:-1], last], add_generation_prompt=False, tools=tools)
        if rendered.count(mark) != 1:
            raise ValueError("the chat template does not render the last message's content as given")
        return self.encode(rendered[:rendered.index(mark)])


@functools.lru_cache(maxsize=8)
def _compiled(chat_template: str) -> jinja2.Template:
    """The template compiled once (compiling Qwen2.5's took ~20 ms, on every request's time to first audio)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    env.filters["tojson"] = _tojson
    return env.from_string(chat_template)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """`tojson` as chat templates are written for (transformers'): keys in order, nothing HTML-escaped.
    Jinja's own sorts keys and escapes `<`, which would change every prompt with tools in it."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def tokenizer_from_folder(folder: Path) -> Tokenizer:
    """A Hugging Face folder: tokenizer.json plus tokenizer_config.json (chat template, EOS)."""
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    template = cfg.get("chat_template") or ""
    if not template and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    eos, bos = _token_text(cfg.get("eos_token")), _token_text(cfg.get("bos_token"))
    eos_ids = {i for i in (backend.token_to_id(eos) if eos else None,) if i is not None}
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        extra = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos_ids |= set(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    special = {i for t, i in backend.get_vocab(with_added_tokens=True).items()
               if t in {a.content for a in backend.get_added_tokens_decoder().values() if a.special}}
    return Tokenizer(backend, template, eos_ids, bos, eos, special)


def _token_text(token: str | dict | None) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")


# llama.cpp names the pre-tokenizer regex by model family; these are the ones we can rebuild.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "default": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    # Qwen2 / Qwen2.5 tokenizer.json: single digits, letters with one leading non-letter, newline runs apart
    "qwen2": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}
# Qwen's tokenizer.json also NFC-normalises text first (so "e" + U+0301 and "é" give the same ids).
_NORMALIZERS = {"qwen2": normalizers.NFC}
# The GGUF names one eos, but chat models end a turn with another token too; stop on all of them
# (what Qwen2.5's generation_config.json lists as eos_token_id).
_STOP_TOKENS = {"qwen2": ("<|im_end|>", "<|endoftext|>")}


def tokenizer_from_gguf(fields: dict) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata."""
    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {fields.get('tokenizer.ggml.model')!r} is not supported "
                         "(only byte-level BPE, 'gpt2'); use a Hugging Face folder with tokenizer.json instead")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(_PRE_TOKENIZERS)})")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     ignore_merges=False))
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    if pre in _NORMALIZERS:
        backend.normalizer = _NORMALIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    control = [i for i, t in enumerate(types) if t == 3]  # llama.cpp token type 3 = control
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    # type 4 = user-defined (Qwen's <tool_call>): matched whole in text like llama.cpp does, but not special
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == 4])
    eos_id = int(fields["tokenizer.ggml.eos_token_id"])
    eos_ids = {eos_id} | {i for t in _STOP_TOKENS.get(pre, ()) if (i := backend.token_to_id(t)) is not None}
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(backend, fields.get("tokenizer.chat_template", ""), eos_ids,
                     tokens[int(bos_id)] if bos_id is not None else "", tokens[eos_id], set(control))
