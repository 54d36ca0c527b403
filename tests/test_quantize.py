"""Fast linear layers (engine/quantize.py): int8 a faithful approximation of the fp32 model, usable
by both decoders and by batched steps; fp16 and int8 rows independent of each other on this CPU's
kernels (checked at run time); a clean fallback to fp32 where the kernels cannot run or cannot keep that."""

import copy

import pytest
import torch
from torch import nn

from engine import quantize as q
from engine.decode import CacheState, DecodeConfig, Forward, run_many
from engine.loading import load, packaged_smollm2_gguf
from engine.stream import Engine

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What's a good way to start my morning?"}],
    [{"role": "system", "content": "You are a friendly voice assistant."},
     {"role": "user", "content": "Tell me a fun fact about the ocean, please."},
     {"role": "assistant", "content": "Octopuses have three hearts and blue blood."},
     {"role": "user", "content": "Wow. And what do they eat?"}],
]


def needs_int8():
    why_not = q.supported("int8")
    if why_not:
        pytest.skip(why_not)


@pytest.fixture(scope="module")
def pair():
    needs_int8()
    path = str(packaged_smollm2_gguf())
    return load(path, max_seq_len=512), load(path, max_seq_len=512, quantize="int8")


REPLY = "Sure! Start with a glass of water, stretch for five minutes, then have a calm breakfast without your phone."


def reply_logits(model, tokenizer, messages) -> torch.Tensor:
    """Logits at each position of a fixed reply, decoded as in production: prefill the prompt,
    then one token per forward through the cache."""
    prompt = tokenizer.encode_chat(messages, add_generation_prompt=True)
    ids = tokenizer.encode_chat(messages + [{"role": "assistant", "content": REPLY}])
    state = CacheState.new(model, 512)
    with torch.no_grad():
        outs = [run_many(model, [Forward(state, prompt)])[0][0]]
        outs += [run_many(model, [Forward(state, [t])])[0][0] for t in ids[len(prompt):-1]]
    return torch.stack(outs)


def test_int8_tracks_fp32_on_the_real_model(pair):
    """Not token for token (`bench/fastpath.py` measures answer accuracy against fp32), but close:
    nearly all next-token choices agree and the distributions stay near."""
    fp32, int8 = pair
    assert (fp32.weights, int8.weights) == ("fp32", "int8")
    assert not any(type(m) is nn.Linear for m in int8.model.modules())
    agree = total = 0
    kls = []
    for messages in CHATS:
        a = reply_logits(fp32.model, fp32.tokenizer, messages)
        b = reply_logits(int8.model, int8.tokenizer, messages)
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += len(a)
        kls.append(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                              reduction="batchmean").item())
    # per-row activation scales: measured 0.95 agreement, KL 0.04-0.05 (one scale per tensor: 0.74, 0.4-0.6)
    assert agree / total >= 0.85, agree / total
    assert max(kls) < 0.2, kls


def rows_independent(layer: nn.Module, rows: torch.Tensor) -> bool:
    """Every row's output, bit for bit, is the one it has alone, among the first 2-16 rows (so at
    every place of every count up to 16: fbgemm's AVX2 kernels change with both)."""
    with torch.no_grad():
        alone = torch.cat([layer(rows[i:i + 1]) for i in range(len(rows))])
        return all(torch.equal(layer(rows[:m]), alone[:m]) for m in range(2, len(rows) + 1))


def fp16_layer(shape: tuple[int, int], group: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(*shape))
    if group is None:
        q.fp16_linears(layer)  # as this CPU needs
    else:
        q._fp16(layer, group)
    return layer


ROWS = {shape: torch.randn(16, shape[0], generator=torch.Generator().manual_seed(1))
        * torch.logspace(-2, 2, 16)[:, None]  # very different magnitudes per row
        for shape in [(576, 1536), (1536, 576), (576, 49152)]}


@pytest.mark.parametrize("shape", list(ROWS))
def test_fp16_rows_do_not_depend_on_each_other(shape):
    """Where fp16 is offered, its layers (fbgemm's fp16 linear, handed rows as this CPU needs) give a
    row the same output alone or among others; where it is not, the model stays fp32."""
    why_not = q.supported("fp16")
    if why_not:
        model = nn.Sequential(nn.Linear(*shape))
        assert q.quantize(model, "fp16") == "fp32" and type(model[0]) is nn.Linear, why_not
        return
    assert rows_independent(fp16_layer(shape), ROWS[shape])


def test_fp16_row_grouping_is_the_first_that_keeps_rows_independent():
    """The run-time probe's choice, checked on a real layer: each grouping tried before it (fbgemm as
    is, on AVX2) really does let rows depend on each other; rows are handed over in that grouping."""
    group = q.fp16_row_group()
    if not group:
        pytest.skip(q.supported("fp16"))
    shape = (576, 1536)
    for cheaper in q.FP16_ROW_GROUPS[:q.FP16_ROW_GROUPS.index(group)]:
        assert not rows_independent(fp16_layer(shape, cheaper), ROWS[shape]), cheaper
    # and so fp16_linears hands them over: the layer's answers stay the linear's, for any number of rows
    torch.manual_seed(0)
    fp32 = nn.Linear(*shape)
    layer = nn.Sequential(copy.deepcopy(fp32))
    q.fp16_linears(layer)
    assert [m.group for m in layer.modules() if isinstance(m, q.RowGroups)] == ([group] if group > 1 else [])
    assert not any(type(m) is nn.Linear for m in layer.modules())
    with torch.no_grad():
        for n in (1, 5, 7):
            x = ROWS[shape][None, :n]
            y, want = layer(x), fp32(x)
            assert y.shape == want.shape == (1, n, shape[1])
            assert torch.allclose(y, want, rtol=1e-2, atol=1e-3 * want.abs().max().item())


@pytest.fixture
def fresh_fp16_probe():
    q.fp16_row_group.cache_clear()
    yield
    q.fp16_row_group.cache_clear()


def test_where_no_grouping_keeps_fp16_rows_independent_the_model_stays_fp32(monkeypatch, caplog, fresh_fp16_probe):
    monkeypatch.setattr(q, "_rows_independent", lambda group: False)
    assert "fp16" in q.supported("fp16") and q.fp16_row_group() == 0
    model, drafter = nn.Sequential(nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8))
    with caplog.at_level("WARNING", logger="engine.quantize"):
        assert q.quantize(model, "fp16") == "fp32"
    assert "fp16 requested but" in caplog.text and "running fp32" in caplog.text
    q.quantize_like(drafter, "fp16")  # a draft head follows: it stays fp32 too
    assert type(model[0]) is nn.Linear and type(drafter[0]) is nn.Linear


def test_int8_is_offered_only_where_its_matmul_is_exact():
    """`torch._int_mm` saturates without VNNI (oneDNN sums int8 products in pairs, in 16 bits): int8
    is offered only where it is exact, at the extremes (products of 127s); elsewhere it stays fp32."""
    a = torch.full((3, 256), 127, dtype=torch.int8)
    a[1], a[2, ::2] = -127, -127
    b = torch.full((256, 16), 127, dtype=torch.int8)
    b[:, 8:] = -127
    try:
        exact = torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    except (RuntimeError, NotImplementedError):
        exact = False
    assert (q.supported("int8") == "") == exact, q.supported("int8")
    if not exact:
        model = nn.Sequential(nn.Linear(16, 16))
        assert q.quantize(model, "int8") == "fp32" and type(model[0]) is nn.Linear


def test_int8_rows_do_not_depend_on_each_other():
    """A row's output is bit for bit the same alone or among other rows: what lets a verified draft
    row equal the AR row, and a batched reply equal the same reply alone."""
    needs_int8()
    torch.manual_seed(0)
    layer = q.Int8RowLinear(nn.Linear(64, 48))
    rows = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # very different magnitudes per row
    together = layer(rows)
    for i in range(len(rows)):
        assert torch.equal(layer(rows[i:i + 1])[0], together[i])
    exact = rows @ layer.qweight.float().t() * layer.scale + layer.bias
    assert torch.allclose(together, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())


def test_int8_model_decodes_in_both_modes_and_in_batches(pair):
    _, int8 = pair
    engine = Engine(int8, max_seq_len=512)
    for mode in ("ar", "diffusion"):
        pieces = list(engine.generate_sync(CHATS[0], DecodeConfig(mode=mode, max_new_tokens=16)))
        text = "".join(p.text for p in pieces)
        assert pieces[-1].done and len(text.split()) >= 2, (mode, text)
    states = [CacheState.new(int8.model, 512) for _ in range(3)]
    prompts = [int8.tokenizer.encode_chat(c, add_generation_prompt=True) for c in CHATS + CHATS[:1]]
    outs = run_many(int8.model, [Forward(s, p) for s, p in zip(states, prompts)])
    for last, _ in outs:
        assert last is not None and last.shape[-1] == int8.model.args.vocab_size and torch.isfinite(last).all()
    assert outs[0][0].argmax() == outs[2][0].argmax()  # the same prompt twice in one batch: the same next token


@pytest.mark.parametrize("how", ["int8", "fp16"])
def test_without_the_kernels_the_model_stays_fp32(monkeypatch, how):
    monkeypatch.setattr(q, "supported", lambda _: f"{how} kernels are unavailable on this CPU (test)")
    model = nn.Sequential(nn.Linear(4, 4))
    assert q.quantize(model, how) == "fp32" and type(model[0]) is nn.Linear
    assert q.quantize(model, "none") == "fp32"


def test_unknown_quantisation_is_refused():
    with pytest.raises(ValueError, match="int4"):
        q.quantize(nn.Sequential(nn.Linear(4, 4)), "int4")
