"""``out`` memory and ``softmax_scale`` range: refused naming the argument, never a wrong result.

An ``out`` two of whose elements share an address (a zero stride, an expanded or overlapping
view), or whose bytes meet an input's (``out=q``, a view into a cache), made the kernels write
over what they still read; a scale beyond the fp32 arithmetic of the kernels made NaN or zeros.
Each entry point must refuse both with a ValueError that starts with the argument's name, and
keep serving, correctly, every layout and scale it served before: transposed or padded outputs,
a disjoint slice of an input's storage, zero, negative and tiny scales, and the bound itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tritune.kernels import Q4KWeight, attention, decode_attention, prefill_attention, q4k_linear, varlen_attention
from tritune.kernels._launch import MAX_SOFTMAX_SCALE, overlaps_itself
from tritune.kernels._numerics import compare
from tritune.kernels.decode.reference import decode_reference
from tritune.kernels.prefill.reference import prefill_reference
from tritune.kernels.q4k.reference import q4k_linear_reference, sqnr_db
from tritune.kernels.varlen.reference import varlen_reference

BF = torch.bfloat16
#: The GPU when there is one, else CPU tensors on the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = (1, 2, 3, 64)  # q and out: [B, Hq, Lq, D]
KV = (1, 1, 8, 64)
ATTENTION = ("prefill", "decode", "attention")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, BF)


def _inputs() -> dict[str, torch.Tensor]:
    return {
        "q": _randn(*SHAPE, seed=1),
        "k": _randn(*KV, seed=2),
        "v": _randn(*KV, seed=3),
        "kv_len": torch.tensor([8], dtype=torch.int32, device=DEVICE),
    }


def _call(entry: str, args: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
    q, k, v, kv_len = args["q"], args["k"], args["v"], args["kv_len"]
    if entry == "prefill":
        return prefill_attention(q, k, v, kv_len=kv_len, **kwargs)
    if entry == "decode":
        return decode_attention(q, k, v, kv_len, **kwargs)
    return attention(q, k, v, kv_len=kv_len, **kwargs)


def _reference(args: dict[str, torch.Tensor], softmax_scale: float | None = None) -> torch.Tensor:
    q, k, v, kv_len = (args[name].clone() for name in ("q", "k", "v", "kv_len"))
    return prefill_reference(q, k, v, kv_len=kv_len, softmax_scale=softmax_scale, dtype=torch.float64)


def _refused(call: Callable[[], Any], name: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    return message


# ---- out: refused layouts and aliases ----------------------------------------------------------


def _expanded_rows(args: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.empty(1, 2, 1, 64, dtype=BF, device=DEVICE).expand(SHAPE)


def _expanded_heads(args: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.empty(1, 1, 3, 64, dtype=BF, device=DEVICE).expand(SHAPE)


def _rows_overlap(args: dict[str, torch.Tensor]) -> torch.Tensor:
    # Each row starts half a row after the previous one.
    return torch.empty(512, dtype=BF, device=DEVICE).as_strided(SHAPE, (192, 96, 32, 1))


def _is_q(args: dict[str, torch.Tensor]) -> torch.Tensor:
    return args["q"]


def _expanded_q(args: dict[str, torch.Tensor]) -> torch.Tensor:
    # q itself an expanded view, and out that same view.
    args["q"] = args["q"][:, :, :1].expand(SHAPE)
    return args["q"]


def _inside_k(args: dict[str, torch.Tensor]) -> torch.Tensor:
    storage = torch.randn(2048).to(DEVICE, BF)
    args["k"] = storage[:512].view(KV)
    return storage[256 : 256 + 384].view(SHAPE)


def _over_kv_len(args: dict[str, torch.Tensor]) -> torch.Tensor:
    # kv_len's four bytes are the first two elements of out.
    buffer = torch.zeros(384, dtype=BF, device=DEVICE)
    args["kv_len"] = buffer[:2].view(torch.int32)
    args["kv_len"].fill_(8)
    return buffer.view(SHAPE)


BAD_OUTS = {
    "zero-stride-rows": (_expanded_rows, "share memory"),
    "zero-stride-heads": (_expanded_heads, "share memory"),
    "overlapping-rows": (_rows_overlap, "share memory"),
    "out-is-q": (_is_q, "overlaps q"),
    "out-is-an-expanded-q": (_expanded_q, "share memory"),
    "inside-k": (_inside_k, "overlaps k"),
    "over-kv_len": (_over_kv_len, "overlaps kv_len"),
}


@pytest.mark.parametrize("case", sorted(BAD_OUTS))
@pytest.mark.parametrize("entry", ATTENTION)
def test_an_out_sharing_memory_is_refused(entry, case):
    args = _inputs()
    make, why = BAD_OUTS[case]
    out = make(args)
    message = _refused(lambda: _call(entry, args, out=out), "out")
    # decode_attention names the caches k_cache and v_cache; attention and prefill call them k and v.
    assert (why + "_cache" if entry == "decode" and why == "overlaps k" else why) in message


# ---- out: served layouts stay served, and correct ----------------------------------------------


def _fresh(args: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.full(SHAPE, float("nan"), dtype=BF, device=DEVICE)


def _transposed(args: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.full((1, 3, 2, 64), float("nan"), dtype=BF, device=DEVICE).transpose(1, 2)


def _padded(args: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.full((1, 2, 3, 128), float("nan"), dtype=BF, device=DEVICE)[..., :64]


def _beside_k(args: dict[str, torch.Tensor]) -> torch.Tensor:
    # One storage, disjoint byte ranges: k reads its half, the kernels write the other.
    storage = torch.randn(2048).to(DEVICE, BF)
    args["k"] = storage[:512].view(KV)
    return storage[1024 : 1024 + 384].view(SHAPE)


GOOD_OUTS = {"fresh": _fresh, "transposed": _transposed, "padded": _padded, "beside-k": _beside_k}


@pytest.mark.parametrize("case", sorted(GOOD_OUTS))
@pytest.mark.parametrize("entry", ATTENTION)
def test_a_separate_out_of_any_served_layout_is_accepted(entry, case):
    args = _inputs()
    out = GOOD_OUTS[case](args)
    assert _call(entry, args, out=out) is out
    assert compare(out, _reference(args), BF) is None


def test_overlaps_itself_sees_only_shared_addresses():
    base = torch.empty(2, 3, 4, 8)
    assert not overlaps_itself(base)
    assert not overlaps_itself(base.permute(2, 0, 3, 1))
    assert not overlaps_itself(base[:, ::2, :, :5])
    assert not overlaps_itself(torch.empty(1, 4).expand(1, 4))  # a zero stride on a dim of size 1
    assert not overlaps_itself(torch.empty(0, 4).expand(3, 0, 4))
    assert overlaps_itself(torch.empty(1, 4).expand(3, 4))
    assert overlaps_itself(torch.empty(10).as_strided((3, 4), (2, 1)))


# ---- varlen_attention and q4k_linear: the same rule ---------------------------------------------


def _varlen_inputs() -> dict[str, torch.Tensor]:
    return {
        "q": _randn(3, 2, 64, seed=4),
        "k_store": _randn(8, 1, 1, 64, seed=5),
        "v_store": _randn(8, 1, 1, 64, seed=6),
        "seq_info": torch.tensor([[0, 3, 0, 8]], dtype=torch.int32, device=DEVICE),
    }


@pytest.mark.parametrize("case", ["zero-stride", "out-is-q", "inside-v_store", "transposed", "padded"])
def test_varlen_out_memory(case):
    args = _varlen_inputs()
    if case == "zero-stride":
        out = torch.empty(1, 2, 64, dtype=BF, device=DEVICE).expand(3, 2, 64)
    elif case == "out-is-q":
        out = args["q"]
    elif case == "inside-v_store":
        out = args["v_store"].view(-1)[:384].view(3, 2, 64)
    elif case == "transposed":
        out = torch.full((2, 3, 64), float("nan"), dtype=BF, device=DEVICE).transpose(0, 1)
    else:
        out = torch.full((3, 2, 128), float("nan"), dtype=BF, device=DEVICE)[..., :64]
    call = lambda: varlen_attention(args["q"], args["k_store"], args["v_store"], args["seq_info"], out=out)  # noqa: E731
    if case in ("transposed", "padded"):
        assert call() is out
        expected = varlen_reference(args["q"], args["k_store"], args["v_store"], args["seq_info"])
        assert compare(out, expected, BF) is None
    else:
        _refused(call, "out")


@pytest.fixture(scope="module")
def q4k_weight() -> Q4KWeight:
    return Q4KWeight.quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(0)).to(DEVICE))


@pytest.mark.parametrize("case", ["out-is-x", "inside-bias", "inside-weight", "fresh"])
def test_q4k_out_memory(case, q4k_weight):
    x = _randn(16, 256, seed=7)
    bias = None
    if case == "out-is-x":
        out = x.view(-1)[: 16 * 16].view(16, 16)
    elif case == "inside-bias":
        storage = torch.zeros(256 + 16, dtype=BF, device=DEVICE)
        bias, out = storage[:16], storage[8 : 8 + 256].view(16, 16)
    elif case == "inside-weight":
        out = q4k_weight.qs.view(-1)[:512].view(BF).view(16, 16)
    else:
        out = torch.full((16, 16), float("nan"), dtype=BF, device=DEVICE)
    call = lambda: q4k_linear(x, q4k_weight, bias, out=out)  # noqa: E731
    if case == "fresh":
        assert call() is out
        assert sqnr_db(out.float(), q4k_linear_reference(x, q4k_weight)) >= 25.0
    else:
        _refused(call, "out")


# ---- softmax_scale -------------------------------------------------------------------------------

BAD_SCALES = {
    "3e38": 3e38,
    "1e30": 1e30,
    "just-past-the-bound": MAX_SOFTMAX_SCALE * (1 + 1e-9),
    "negative-past-the-bound": -2 * MAX_SOFTMAX_SCALE,
    "inf": float("inf"),
    "-inf": -float("inf"),
    "nan": float("nan"),
    "huge-int": 10**400,
}


@pytest.mark.parametrize("scale", sorted(BAD_SCALES))
@pytest.mark.parametrize("entry", [*ATTENTION, "varlen"])
def test_a_scale_the_kernels_cannot_apply_is_refused(entry, scale):
    value = BAD_SCALES[scale]
    if entry == "varlen":
        args = _varlen_inputs()
        call = lambda: varlen_attention(*args.values(), softmax_scale=value)  # noqa: E731
    else:
        args = _inputs()
        call = lambda: _call(entry, args, softmax_scale=value)  # noqa: E731
    message = _refused(call, "softmax_scale")
    assert f"<= {MAX_SOFTMAX_SCALE:g}" in message


GOOD_SCALES = {
    "zero": 0.0,
    "tiny": 1e-30,
    "negative": -0.3,
    "int": 2,
    "the-bound": MAX_SOFTMAX_SCALE,
    "minus-the-bound": -MAX_SOFTMAX_SCALE,
}


@pytest.mark.parametrize("scale", sorted(GOOD_SCALES))
@pytest.mark.parametrize("entry", [*ATTENTION, "varlen"])
def test_every_scale_within_the_bound_is_served_correctly(entry, scale):
    value = GOOD_SCALES[scale]
    if entry == "varlen":
        args = _varlen_inputs()
        out = varlen_attention(*args.values(), softmax_scale=value)
        expected = varlen_reference(*args.values(), softmax_scale=value)
    else:
        args = _inputs()
        out = _call(entry, args, softmax_scale=value)
        expected = _reference(args, softmax_scale=value)
    assert compare(out, expected, BF) is None


def test_decode_reference_agrees_with_the_prefill_reference():
    """The attention tests above judge decode calls by the prefill reference: the same contract."""
    args = _inputs()
    decode = decode_reference(args["q"], args["k"], args["v"], args["kv_len"])
    assert compare(decode, _reference(args), torch.float32) is None


@pytest.mark.parametrize(
    ("shape", "box", "view"),
    [
        ((2, 4, 64, 128), [1, 2, 32, 128], lambda t: t),
        ((2, 4, 64, 128), [1, 1, 64, 128], lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        ((96, 8, 2, 64), [32, 1, 1, 64], lambda t: t[16:80]),
    ],
)
def test_an_unchecked_descriptor_has_the_fields_from_tensor_gives(shape, box, view) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from tritune.kernels._launch import unchecked_descriptor

    t = view(torch.randn(shape).to(torch.bfloat16))
    assert unchecked_descriptor(t, box) == TensorDescriptor.from_tensor(t, box)


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t,
        lambda t: t.flatten()[1:101].view(10, 10),  # 2 bytes past an aligned address
        lambda t: t[:, ::3],  # strided columns
        lambda t: t.t(),  # transposed
        lambda t: t[2:2],  # empty
    ],
    ids=["contiguous", "misaligned", "strided", "transposed", "empty"],
)
def test_same_layout_keeps_what_triton_specializes_on(view) -> None:
    from tritune.kernels._launch import same_layout

    t = view(torch.randn(12, 12).to(torch.bfloat16))
    copy = same_layout(t)
    assert (copy.shape, copy.stride(), copy.dtype, copy.device) == (t.shape, t.stride(), t.dtype, t.device)
    if t.numel():
        assert copy.data_ptr() % 16 == t.data_ptr() % 16
        assert copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
