"""Bad arguments thrown at every public entry point: each must be refused, naming what is wrong.

For each entry point a valid tiny call is drawn (shapes, GQA ratio, dtype, optional arguments),
then one named mutation makes exactly one thing wrong: a dtype, a device (``meta`` against ``cpu``),
a rank, a shape that does not match, heads that do not divide, a ``kv_len`` of the wrong type,
dtype or shape, a flag or scale of the wrong type. The call must raise ``TypeError`` or
``ValueError`` whose message starts with the offending argument's name (``"kv_len: ..."``, or
``"q, k: ..."`` where two arguments disagree). Another exception type, or a result, fails.

Out-of-range ``kv_len`` values are not an error by contract (they are read on the device, where
checking would synchronise, and clamped): that is tested as equal to the clamped call instead.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tritune.kernels import Q4KWeight, attention, decode_attention, prefill_attention, q4k_linear

BF, FP = torch.bfloat16, torch.float16
META = torch.device("meta")
#: Few examples, the same ones on every run, and no shrinking: a failing example is already tiny.
FUZZ = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Dtypes no attention entry point takes.
BAD_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int8, torch.uint8, torch.bool)
NOT_TENSORS = (None, 1.0, "q", [[1.0]], np.zeros((1, 1, 1, 64), dtype=np.float16))

Mutation = Callable[[Any, dict[str, Any]], set[str]]


def labels(message: str) -> set[str]:
    """The argument names a message starts with: ``"k, v: ..."`` -> {k, v}; ``"seq_info[2]: ..."`` -> {seq_info}."""
    head = message.split(": ", 1)[0]
    return {re.sub(r"\[.*\]$", "", part.strip()) for part in head.split(",")}


def expect_refusal(call: Callable[[], Any], offenders: set[str]) -> None:
    try:
        result = call()
    except (TypeError, ValueError) as exc:
        assert labels(str(exc)) & offenders, f"{type(exc).__name__}({exc!s}) does not name any of {sorted(offenders)}"
        return
    pytest.fail(f"accepted (returned {type(result).__name__}); expected a refusal naming {sorted(offenders)}")


def tensor(shape: tuple[int, ...], dtype: torch.dtype = BF) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.ones(shape, dtype=dtype)


def other_dtype(draw: Any, dtype: torch.dtype) -> torch.dtype:
    return draw(st.sampled_from([d for d in (*BAD_DTYPES, BF, FP) if d != dtype]))


def reshaped(draw: Any, t: torch.Tensor) -> torch.Tensor:
    """The same data with one dimension more or one fewer."""
    return t.unsqueeze(0) if draw(st.booleans()) or t.dim() == 1 else t[0]


# ---- attention calls -----------------------------------------------------------------------------


def attention_call(draw: Any, *, lq_max: int, kv_name: str) -> dict[str, Any]:
    batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group, lq = draw(st.integers(1, 3)), draw(st.integers(1, lq_max))
    lkv = draw(st.integers(lq, 9))
    dtype = draw(st.sampled_from([BF, FP]))
    call = {
        "q": tensor((batch, kv_heads * group, lq, 64), dtype),
        f"k{kv_name}": tensor((batch, kv_heads, lkv, 64), dtype),
        f"v{kv_name}": tensor((batch, kv_heads, lkv, 64), dtype),
        "kv_len": torch.full((batch,), lkv, dtype=torch.int32),
    }
    if draw(st.booleans()):
        call["out"] = torch.empty_like(call["q"])
    return call


def mutate_dtype(name: str, partners: tuple[str, ...] | None = None) -> Mutation:
    """A dtype no kernel takes (blame ``name``), or, where ``partners`` must match it, the other served one."""

    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        dtype = other_dtype(draw, call[name].dtype) if partners is not None else draw(st.sampled_from(BAD_DTYPES))
        call[name] = call[name].to(dtype)
        return {name, *(partners or ())} if dtype in (BF, FP) else {name}

    return mutation


def mutate_type(name: str) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        call[name] = draw(st.sampled_from(NOT_TENSORS))
        return {name}

    return mutation


def mutate_layout(names: tuple[str, ...]) -> Mutation:
    """One of ``names`` (a tensor in the call) made sparse, or nested over its first dim."""

    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        name = draw(st.sampled_from([n for n in names if isinstance(call.get(n), torch.Tensor)]))
        t = call[name]
        if draw(st.booleans(), label="nested"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype API
                call[name] = torch.nested.nested_tensor(list(t.unbind(0)))
        else:
            call[name] = t.to_sparse()
        return {name}

    return mutation


def mutate_rank(name: str) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        call[name] = reshaped(draw, call[name])
        return {name}

    return mutation


def mutate_device(name: str) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        call[name] = call[name].to(META)
        return {name}

    return mutation


def all_on_meta(first: str) -> Mutation:
    """Every tensor on ``meta``: consistent, but no device the kernels run on."""

    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        for name, value in call.items():
            if isinstance(value, torch.Tensor):
                call[name] = value.to(META)
        return {first}

    return mutation


def mutate_scalar(name: str, values: tuple[Any, ...]) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        call[name] = draw(st.sampled_from(values))
        return {name}

    return mutation


def mutate_head_dim(kv: tuple[str, str]) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        d = draw(st.sampled_from([16, 48, 65, 72, 192]))
        for name in ("q", *kv, "out"):
            if name in call:
                shape = call[name].shape
                call[name] = tensor((*shape[:-1], d), call[name].dtype)
        return {"q"}

    return mutation


def mutate_kv_head_dim(kv: tuple[str, str]) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        name = draw(st.sampled_from(kv))
        shape = call[name].shape
        call[name] = tensor((*shape[:-1], draw(st.sampled_from([32, 128]))), call[name].dtype)
        return set(kv)

    return mutation


def mutate_gqa(kv: tuple[str, str]) -> Mutation:
    """Query heads that are not a multiple of the KV heads."""

    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        b, _, lkv, d = call[kv[0]].shape
        kv_heads = draw(st.sampled_from([2, 4]))
        q_heads = draw(st.sampled_from([h for h in (1, 3, 5, 6) if h % kv_heads]))
        for name in kv:
            call[name] = tensor((b, kv_heads, lkv, d), call[name].dtype)
        call["q"] = tensor((b, q_heads, *call["q"].shape[2:]), call["q"].dtype)
        call.pop("out", None)
        return {"q", kv[0]}

    return mutation


def mutate_kv_dim(kv: tuple[str, str], axis: int) -> Mutation:
    """One of K and V differs from the other (axis 0: batch, 2: length)."""

    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        name = draw(st.sampled_from(kv))
        shape = list(call[name].shape)
        shape[axis] += draw(st.integers(1, 2))
        call[name] = tensor(tuple(shape), call[name].dtype)
        return set(kv)

    return mutation


def mutate_kv_len_shape(draw: Any, call: dict[str, Any]) -> set[str]:
    batch = call["q"].shape[0]
    shape = draw(st.sampled_from([(batch + 1,), (batch, 1), (1, batch, 1)]))
    call["kv_len"] = torch.ones(shape, dtype=torch.int32)
    return {"kv_len"}


def mutate_kv_len_dtype(draw: Any, call: dict[str, Any]) -> set[str]:
    call["kv_len"] = call["kv_len"].to(draw(st.sampled_from([torch.int64, torch.int16, torch.float32, torch.uint8])))
    return {"kv_len"}


def mutate_kv_len_type(draw: Any, call: dict[str, Any]) -> set[str]:
    call["kv_len"] = draw(st.sampled_from([3, 3.0, [3], (3,), np.array([3], dtype=np.int32)]))
    return {"kv_len"}


def mutate_out_shape(draw: Any, call: dict[str, Any]) -> set[str]:
    shape = list(call["q"].shape)
    shape[draw(st.integers(0, len(shape) - 1))] += 1
    call["out"] = tensor(tuple(shape), call["q"].dtype)
    return {"out"}


def mutate_out(kind: str) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        q = call["q"]
        if kind == "dtype":
            call["out"] = torch.empty(q.shape, dtype=other_dtype(draw, q.dtype))
        elif kind == "device":
            call["out"] = torch.empty(q.shape, dtype=q.dtype, device=META)
        else:
            call["out"] = draw(st.sampled_from([[0.0], "out", 1]))
        return {"out"}

    return mutation


BAD_SCALES = ("0.1", True, [0.1], float("nan"), float("inf"), -float("inf"))
BAD_FLAGS = (1, 0, "yes", None, np.bool_(True))


def attention_mutations(kv: tuple[str, str], with_causal: bool) -> dict[str, Mutation]:
    k, v = kv
    mutations = {
        "q-dtype": mutate_dtype("q", kv),
        "k-dtype": mutate_dtype(k, ("q",)),
        "v-dtype": mutate_dtype(v, ("q",)),
        "q-type": mutate_type("q"),
        "k-type": mutate_type(k),
        "v-type": mutate_type(v),
        "q-rank": mutate_rank("q"),
        "k-rank": mutate_rank(k),
        "v-rank": mutate_rank(v),
        "k-meta": mutate_device(k),
        "v-meta": mutate_device(v),
        "kv_len-meta": mutate_device("kv_len"),
        "all-meta": all_on_meta("q"),
        "head-dim": mutate_head_dim(kv),
        "kv-head-dim": mutate_kv_head_dim(kv),
        "gqa": mutate_gqa(kv),
        "kv-batch": mutate_kv_dim(kv, 0),
        "kv-length": mutate_kv_dim(kv, 2),
        "kv_len-shape": mutate_kv_len_shape,
        "kv_len-dtype": mutate_kv_len_dtype,
        "kv_len-type": mutate_kv_len_type,
        "softmax_scale": mutate_scalar("softmax_scale", BAD_SCALES),
        "out-shape": mutate_out_shape,
        "out-dtype": mutate_out("dtype"),
        "out-meta": mutate_out("device"),
        "out-type": mutate_out("type"),
        "layout": mutate_layout(("q", k, v, "out")),
    }
    if with_causal:
        mutations["causal"] = mutate_scalar("causal", BAD_FLAGS)
    return mutations


PREFILL = attention_mutations(("k", "v"), with_causal=True)
DECODE = attention_mutations(("k_cache", "v_cache"), with_causal=False)
DECODE["kv_len-missing"] = mutate_scalar("kv_len", (None,))
DECODE["too-many-queries"] = lambda draw, call: _more_queries(call)
DECODE["strided-head-dim"] = lambda draw, call: _strided(draw, call)


def _more_queries(call: dict[str, Any]) -> set[str]:
    b, h, _, d = call["q"].shape
    call["q"] = tensor((b, h, 9, d), call["q"].dtype)
    call.pop("out", None)
    return {"q"}


def _strided(draw: Any, call: dict[str, Any]) -> set[str]:
    name = draw(st.sampled_from(["q", "k_cache", "v_cache"]))
    t = call[name]
    # Same shape, but every other element of a wider buffer: the head dim has stride 2.
    call[name] = tensor((*t.shape[:-1], 2 * t.shape[-1]), t.dtype)[..., ::2]
    return {name}


@pytest.mark.parametrize("mutation", sorted(PREFILL))
@FUZZ
@given(data=st.data())
def test_prefill_attention_refuses(mutation, data):
    call = attention_call(data.draw, lq_max=5, kv_name="")
    if data.draw(st.booleans(), label="without kv_len") and not mutation.startswith("kv_len"):
        del call["kv_len"]
    offenders = PREFILL[mutation](data.draw, call)
    expect_refusal(lambda: prefill_attention(call.pop("q"), call.pop("k"), call.pop("v"), **call), offenders)


@pytest.mark.parametrize("mutation", sorted(DECODE))
@FUZZ
@given(data=st.data())
def test_decode_attention_refuses(mutation, data):
    call = attention_call(data.draw, lq_max=8, kv_name="_cache")
    offenders = DECODE[mutation](data.draw, call)
    args = (call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), call.pop("kv_len"))
    expect_refusal(lambda: decode_attention(*args, **call), offenders)


@pytest.mark.parametrize("mutation", sorted(PREFILL))
@FUZZ
@given(data=st.data())
def test_attention_refuses(mutation, data):
    # Decode steps reach decode_attention, whose errors must still call k and v by attention's names.
    call = attention_call(data.draw, lq_max=9, kv_name="")
    offenders = PREFILL[mutation](data.draw, call)
    expect_refusal(lambda: attention(call.pop("q"), call.pop("k"), call.pop("v"), **call), offenders)


# ---- q4k_linear and Q4KWeight ----------------------------------------------------------------------

N, K = 16, 256


@pytest.fixture(scope="module")
def weight() -> Q4KWeight:
    return Q4KWeight.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)))


def q4k_call(draw: Any) -> dict[str, Any]:
    lead = draw(st.sampled_from([(1,), (3,), (2, 2)]))
    dtype = draw(st.sampled_from([BF, FP]))
    call: dict[str, Any] = {"x": tensor((*lead, K), dtype)}
    if draw(st.booleans()):
        call["bias"] = tensor((N,), draw(st.sampled_from([BF, FP, torch.float32])))
    if draw(st.booleans()):
        call["out"] = torch.empty((*lead, N), dtype=dtype)
    return call


def _q4k_x_shape(draw: Any, call: dict[str, Any]) -> set[str]:
    x = call["x"]
    call["x"] = draw(st.sampled_from([tensor((*x.shape[:-1], K + 1), x.dtype), tensor((), x.dtype), x[..., :128]]))
    call.pop("out", None)
    return {"x"}


def _q4k_bias(kind: str) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        if kind == "shape":
            call["bias"] = tensor(draw(st.sampled_from([(N + 1,), (1, N), (N, 1)])))
        elif kind == "dtype":
            call["bias"] = torch.ones(N, dtype=draw(st.sampled_from([torch.int32, torch.int64, torch.bool])))
        elif kind == "device":
            call["bias"] = torch.zeros(N, dtype=BF, device=META)
        else:
            call["bias"] = draw(st.sampled_from([[0.0] * N, 0.0, np.zeros(N, dtype=np.float32)]))
        return {"bias"}

    return mutation


def _q4k_out(kind: str) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        x = call["x"]
        shape = (*x.shape[:-1], N)
        if kind == "shape":
            call["out"] = torch.empty((*x.shape[:-1], N + 1), dtype=x.dtype)
        elif kind == "dtype":
            call["out"] = torch.empty(shape, dtype=other_dtype(draw, x.dtype))
        elif kind == "device":
            call["out"] = torch.empty(shape, dtype=x.dtype, device=META)
        elif kind == "strided":
            call["out"] = torch.empty((*x.shape[:-1], 2 * N), dtype=x.dtype)[..., ::2]
        else:
            call["out"] = draw(st.sampled_from([[0.0], "out", 1]))
        return {"out"}

    return mutation


def _q4k_weight_type(draw: Any, call: dict[str, Any]) -> set[str]:
    call["weight"] = draw(st.sampled_from([torch.randn(N, K), None, "weight", np.zeros((N, 144), dtype=np.uint8)]))
    return {"weight"}


Q4K = {
    "x-dtype": mutate_dtype("x"),
    "x-type": mutate_type("x"),
    "x-shape": _q4k_x_shape,
    # x first sets the device; the weight, on the CPU, is then the one refused for disagreeing.
    "x-meta": lambda draw, call: mutate_device("x")(draw, call) | {"weight"},
    "all-meta": all_on_meta("x"),
    "weight-type": _q4k_weight_type,
    "bias-shape": _q4k_bias("shape"),
    "bias-dtype": _q4k_bias("dtype"),
    "bias-meta": _q4k_bias("device"),
    "bias-type": _q4k_bias("type"),
    "out-shape": _q4k_out("shape"),
    "out-dtype": _q4k_out("dtype"),
    "out-meta": _q4k_out("device"),
    "out-strided": _q4k_out("strided"),
    "out-type": _q4k_out("type"),
    "layout": mutate_layout(("x", "bias", "out")),
}


@pytest.mark.parametrize("mutation", sorted(Q4K))
@FUZZ
@given(data=st.data())
def test_q4k_linear_refuses(mutation, weight, data):
    call = q4k_call(data.draw)
    call["weight"] = weight
    offenders = Q4K[mutation](data.draw, call)
    if mutation == "all-meta":
        call["weight"] = weight.to(META)
    expect_refusal(lambda: q4k_linear(call.pop("x"), call.pop("weight"), **call), offenders)


def _blocks_raw(draw: Any, call: dict[str, Any]) -> set[str]:
    raw = call["raw"]
    call["raw"] = draw(
        st.sampled_from(
            [
                raw.to(torch.int8),
                raw.float(),
                raw.numpy().astype(np.int16),
                raw.tolist(),
                None,
                raw.reshape(-1),
                raw[:, :-1],
                raw[:-1],
            ]
        )
    )
    return {"raw"}


def _blocks_shape(draw: Any, call: dict[str, Any]) -> set[str]:
    n, k = call["shape"]
    call["shape"] = draw(
        st.sampled_from(
            [None, (n,), (n, k, 1), (float(n), k), (n, "256"), (True, k), (-n, k), (n, k + 1), (n, 0), (n, 128), n * k]
        )
    )
    return {"shape", "raw"} if call["shape"] in ((n, k + 1), (n, 128)) else {"shape"}


@pytest.mark.parametrize("mutation", ["raw", "shape"])
@FUZZ
@given(data=st.data())
def test_q4k_weight_from_blocks_refuses(mutation, weight, data):
    call = {"raw": weight.to_blocks(), "shape": weight.shape}
    offenders = {"raw": _blocks_raw, "shape": _blocks_shape}[mutation](data.draw, call)
    expect_refusal(lambda: Q4KWeight.from_blocks(call["raw"], call["shape"]), offenders)


# ---- varlen_attention and validate_seq_info --------------------------------------------------------


def varlen_call(draw: Any) -> dict[str, Any]:
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    rows, cols, tokens = draw(st.integers(4, 8)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([BF, FP]))
    call = {
        "q": tensor((tokens, kv_heads * group, 64), dtype),
        "k_store": tensor((rows, cols, kv_heads, 64), dtype),
        "v_store": tensor((rows, cols, kv_heads, 64), dtype),
        "seq_info": torch.tensor([[0, tokens, 0, rows]], dtype=torch.int32),
    }
    if draw(st.booleans()):
        call["out"] = torch.empty_like(call["q"])
    return call


def _varlen_gqa(draw: Any, call: dict[str, Any]) -> set[str]:
    rows, cols, _, d = call["k_store"].shape
    for name in ("k_store", "v_store"):
        call[name] = tensor((rows, cols, 2, d), call[name].dtype)
    call["q"] = tensor((call["q"].shape[0], draw(st.sampled_from([1, 3, 5])), d), call["q"].dtype)
    call.pop("out", None)
    return {"q", "k_store"}


def _seq_info(kind: str) -> Mutation:
    def mutation(draw: Any, call: dict[str, Any]) -> set[str]:
        info = call["seq_info"]
        if kind == "dtype":
            call["seq_info"] = info.to(draw(st.sampled_from([torch.int64, torch.float32, torch.int16])))
        elif kind == "shape":
            empty = torch.empty((0, 4), dtype=torch.int32)
            call["seq_info"] = draw(st.sampled_from([info[:, :3], info.reshape(-1), empty]))
        elif kind == "device":
            call["seq_info"] = info.to(META)
        else:
            call["seq_info"] = draw(st.sampled_from([info.tolist(), None, 4]))
        return {"seq_info"}

    return mutation


VARLEN = {
    "q-dtype": mutate_dtype("q", ("k_store", "v_store")),
    "k-dtype": mutate_dtype("k_store", ("q",)),
    "q-type": mutate_type("q"),
    "v-type": mutate_type("v_store"),
    "q-rank": mutate_rank("q"),
    "k-rank": mutate_rank("k_store"),
    "v-meta": mutate_device("v_store"),
    "all-meta": all_on_meta("q"),
    "head-dim": lambda draw, call: _varlen_head_dim(draw, call),
    "gqa": _varlen_gqa,
    "seq_info-dtype": _seq_info("dtype"),
    "seq_info-shape": _seq_info("shape"),
    "seq_info-meta": _seq_info("device"),
    "seq_info-type": _seq_info("type"),
    "causal": mutate_scalar("causal", BAD_FLAGS),
    "ring": mutate_scalar("ring", BAD_FLAGS),
    "window": mutate_scalar("window", (0, -4, 2.5, True, "8")),
    "softmax_scale": mutate_scalar("softmax_scale", BAD_SCALES),
    "out-shape": mutate_out_shape,
    "out-dtype": mutate_out("dtype"),
    "out-type": mutate_out("type"),
    "layout": mutate_layout(("q", "k_store", "v_store", "seq_info", "out")),
}


def _varlen_head_dim(draw: Any, call: dict[str, Any]) -> set[str]:
    d = draw(st.sampled_from([16, 48, 65]))
    for name in ("q", "k_store", "v_store", "out"):
        if name in call:
            call[name] = tensor((*call[name].shape[:-1], d), call[name].dtype)
    return {"q"}


@pytest.mark.parametrize("mutation", sorted(VARLEN))
@FUZZ
@given(data=st.data())
def test_varlen_attention_refuses(mutation, data):
    from tritune.kernels import varlen_attention

    call = varlen_call(data.draw)
    offenders = VARLEN[mutation](data.draw, call)
    args = (call.pop("q"), call.pop("k_store"), call.pop("v_store"), call.pop("seq_info"))
    expect_refusal(lambda: varlen_attention(*args, **call), offenders)


def _bad_table(draw: Any, tokens: int, rows: int, cols: int) -> tuple[list[list[int]], str]:
    """A seq_info table wrong in one way, and why."""
    kind = draw(st.sampled_from(["negative", "past-T", "column", "past-rows", "q_len>kv_end", "overlap"]))
    good = [0, tokens, 0, rows]
    if kind == "negative":
        entry = list(good)
        entry[draw(st.integers(0, 3))] = -draw(st.integers(1, 5))
        return [entry], kind
    if kind == "past-T":
        return [[1, tokens, 0, rows]], kind
    if kind == "column":
        return [[0, tokens, cols + draw(st.integers(0, 2)), rows]], kind
    if kind == "past-rows":
        return [[0, tokens, 0, rows + draw(st.integers(1, 3))]], kind
    if kind == "q_len>kv_end":
        return [[0, tokens, 0, tokens - 1]], kind
    return [[0, tokens, 0, rows], [tokens - 1, 1, min(1, cols - 1), rows]], kind


@FUZZ
@given(data=st.data())
def test_validate_seq_info_refuses_bad_tables(data):
    from tritune.kernels import validate_seq_info

    tokens, rows, cols = data.draw(st.integers(1, 4)), data.draw(st.integers(4, 8)), data.draw(st.integers(1, 3))
    table, _ = _bad_table(data.draw, tokens, rows, cols)
    info = torch.tensor(table, dtype=torch.int32)
    expect_refusal(lambda: validate_seq_info(info, T=tokens, rows=rows, cols=cols), {"seq_info"})


@FUZZ
@given(data=st.data())
def test_validate_seq_info_refuses_bad_arguments(data):
    from tritune.kernels import validate_seq_info

    call = {"seq_info": torch.tensor([[0, 2, 0, 4]], dtype=torch.int32), "T": 2, "rows": 4, "cols": 1}
    name = data.draw(st.sampled_from(["seq_info", "T", "rows", "cols"]))
    if name == "seq_info":
        call[name] = data.draw(st.sampled_from([call[name].long(), call[name][:, :3], [[0, 2, 0, 4]], None]))
    else:
        call[name] = data.draw(st.sampled_from([None, "4", 4.0, True, -1]))
    table = call.pop("seq_info")
    expect_refusal(lambda: validate_seq_info(table, **call), {name})


# ---- CPU tensors without the interpreter ---------------------------------------------------------

_WITHOUT_INTERPRETER = """
import torch
from tritune.kernels import Q4KWeight, attention, decode_attention, prefill_attention, q4k_linear, varlen_attention

q = torch.randn(1, 2, 1, 64).to(torch.bfloat16)
k = torch.randn(1, 1, 8, 64).to(torch.bfloat16)
kv_len = torch.tensor([8], dtype=torch.int32)
store = torch.randn(8, 1, 1, 64).to(torch.bfloat16)
info = torch.tensor([[0, 1, 0, 8]], dtype=torch.int32)
weight = Q4KWeight.quantize(torch.randn(16, 256))
calls = {
    "prefill_attention": lambda: prefill_attention(q, k, k, kv_len=kv_len),
    "decode_attention": lambda: decode_attention(q, k, k, kv_len),
    "attention": lambda: attention(q, k, k, kv_len=kv_len),
    "varlen_attention": lambda: varlen_attention(q[0].transpose(0, 1), store, store, info),
    "q4k_linear": lambda: q4k_linear(torch.randn(2, 256).to(torch.bfloat16), weight),
}
for name, call in calls.items():
    try:
        call()
    except Exception as exc:
        print(f"{name}|{type(exc).__name__}|{exc}")
    else:
        print(f"{name}|accepted|")
"""


def test_cpu_tensors_without_the_interpreter_are_refused(tmp_path):
    """Without ``TRITON_INTERPRET=1`` a CPU call is refused up front, naming the tensor and the way out."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", TRITUNE_DB=str(tmp_path / "configs.sqlite"), TRITUNE_DISABLE_BUNDLES="1")
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_INTERPRETER], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    results = dict(line.split("|", 1) for line in run.stdout.splitlines())
    assert sorted(results) == ["attention", "decode_attention", "prefill_attention", "q4k_linear", "varlen_attention"]
    for name, result in results.items():
        error, message = result.split("|", 1)
        assert error == "ValueError", f"{name}: {result}"
        assert message.startswith("x: " if name == "q4k_linear" else "q: "), f"{name}: {message}"
        assert "TRITON_INTERPRET=1" in message, f"{name}: {message}"


# ---- controls: the valid calls behind every mutation run, and kv_len out of range is clamped -----


def test_the_unmutated_calls_are_accepted(weight):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 64, generator=gen).to(BF), torch.randn(1, 1, 5, 64, generator=gen).to(BF)
    kv_len = torch.tensor([5], dtype=torch.int32)
    assert prefill_attention(q, k, k, kv_len=kv_len).shape == q.shape
    assert decode_attention(q, k, k, kv_len).shape == q.shape
    assert attention(q, k, k, kv_len=kv_len).shape == q.shape
    assert q4k_linear(torch.randn(2, K).to(BF), weight).shape == (2, N)
    assert Q4KWeight.from_blocks(weight.to_blocks(), weight.shape).shape == (N, K)


def test_the_unmutated_varlen_call_is_accepted():
    from tritune.kernels import validate_seq_info, varlen_attention

    q, store = torch.randn(3, 2, 64).to(BF), torch.randn(4, 1, 1, 64).to(BF)
    info = torch.tensor([[0, 3, 0, 4]], dtype=torch.int32)
    validate_seq_info(info, T=3, rows=4, cols=1)
    assert varlen_attention(q, store, store, info).shape == q.shape


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_kv_len_out_of_range_is_clamped_not_refused(entry):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 2, 64, generator=gen).to(BF) for _ in range(3))
    run = (
        (lambda n: prefill_attention(q, k, v, kv_len=n))
        if entry == "prefill"
        else (lambda n: decode_attention(q, k, v, n))
    )
    clamped = run(torch.tensor([0, 2], dtype=torch.int32))
    wild = run(torch.tensor([-7, 1_000_000], dtype=torch.int32))
    torch.testing.assert_close(wild, clamped, rtol=0, atol=0)
    assert not math.isnan(float(wild[1].float().abs().max()))


# ---- served correctly or refused: out memory, strides and scales -----------------------------------
#
# A valid tiny call, then draws of each tensor's layout, of ``out`` (fresh, transposed, padded, or
# sharing memory with itself or an input) and of the scale (within the bound, zero and negative
# ones included, or past it). Whatever is drawn, the call must either raise naming one of the
# arguments that make it wrong, or, where nothing does, return the fp64 reference's result within
# the dtype's tolerance. Refusing a valid call fails as surely as a wrong result. What makes a call
# wrong is decided from the tensors themselves (:func:`shares_memory` counts bytes), not from how
# they were drawn. Each test runs once per fault: none (valid calls of every layout), one kind of
# wrong argument, or anything at all, so that every kind gets its share of the fixed budget.

#: A fixed budget per entry point and fault: the accepted calls run on the interpreter.
FUZZ_RUNS = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: What a drawn call gets wrong: "stride" is a head dim of stride 2 somewhere, which prefill serves.
FAULTS = ("none", "out", "scale", "stride", "any")
GOOD_SCALES = (None, 0.0, 1e-30, 0.05, -0.125, 0.5, -2.0, 7, 1e4, -1e4)
PAST_THE_BOUND = (1e4 * (1 + 1e-6), -1e5, 3e38, -3e38, float("inf"), -float("inf"), float("nan"), 10**400)
#: Layouts with a head dim of stride 1 ("expanded": a zero stride on the first dim, for inputs only).
LAYOUTS = ("contiguous", "transposed", "padded", "expanded")
#: ``out`` cases meant to share memory (with itself or an input).
SHARING_OUTS = ("zero-stride", "overlapping-rows", "is-q", "inside-k")
SEPARATE_OUTS = ("none", "fresh", "transposed", "padded", "beside-k")


def draw_layouts(draw: Any, names: tuple[str, ...], fault: str) -> dict[str, str]:
    """A layout for each tensor of ``names`` (and "out"'s, where the stride fault falls on it)."""
    layouts = {name: draw(st.sampled_from(LAYOUTS[:3] if name == names[0] else LAYOUTS)) for name in names}
    if fault == "stride":
        layouts[draw(st.sampled_from([*names, "out"]))] = "head-strided"
    elif fault == "any":
        for name in names:
            if draw(st.booleans()):
                layouts[name] = "head-strided"
    return layouts


def draw_scale(draw: Any, fault: str) -> Any:
    choices = {"scale": PAST_THE_BOUND, "any": GOOD_SCALES + PAST_THE_BOUND}.get(fault, GOOD_SCALES)
    return draw(st.sampled_from(choices))


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (any rank >= 3) copied into a tensor of ``layout`` with the same shape."""
    shape = values.shape
    if layout == "transposed":
        # The two dims before the last swapped in memory (BSHD storage seen as BHSD).
        t = torch.empty((*shape[:-3], shape[-2], shape[-3], shape[-1]), dtype=values.dtype).transpose(-2, -3)
    elif layout == "padded":
        t = torch.empty((*shape[:-1], shape[-1] + 8), dtype=values.dtype)[..., : shape[-1]]
    elif layout == "head-strided":
        t = torch.empty((*shape[:-1], 2 * shape[-1]), dtype=values.dtype)[..., ::2]
    elif layout == "expanded":
        return values[:1].expand(shape)
    else:
        t = torch.empty(shape, dtype=values.dtype)
    return t.copy_(values)


def draw_out(
    draw: Any, fault: str, layouts: dict[str, str], q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(out, k)``: an out of q's shape and dtype; ``k`` is moved into out's storage (same values)
    for the ``*-k`` cases."""
    choices = {"out": SHARING_OUTS, "any": SEPARATE_OUTS + SHARING_OUTS}.get(fault, SEPARATE_OUTS)
    case = "head-strided" if layouts.get("out") == "head-strided" else draw(st.sampled_from(choices))
    shape, dtype = q.shape, q.dtype
    if case == "none":
        return None, k
    if case in ("fresh", "transposed", "padded", "head-strided"):
        return laid_out(torch.full(shape, float("nan"), dtype=dtype), "contiguous" if case == "fresh" else case), k
    if case == "zero-stride":
        return torch.empty((*shape[:-2], 1, shape[-1]), dtype=dtype).expand(shape), k
    if case == "overlapping-rows":
        # Each row starts half a row after the previous one.
        rows, row = math.prod(shape[:-1]), shape[-1]
        strides = [row // 2]
        for size in reversed(shape[1:-1]):
            strides.insert(0, strides[0] * size)
        return torch.empty(rows * row, dtype=dtype).as_strided(shape, (*strides, 1)), k
    if case == "is-q":
        return q, k
    size = math.prod(shape)
    storage = torch.empty(k.numel() + size + 64, dtype=dtype)
    moved = storage[: k.numel()].view(k.shape).copy_(k)
    start = k.numel() // 2 if case == "inside-k" else k.numel()
    return storage[start : start + size].view(shape), moved


def _element_bytes(t: torch.Tensor) -> list[int]:
    """Every byte of every element of ``t``, as offsets in its storage (one entry per element byte)."""
    size = t.element_size()
    elements = torch.arange(t.untyped_storage().nbytes() // size)
    offsets = torch.as_strided(elements, t.shape, t.stride(), t.storage_offset()).flatten()
    return (offsets[:, None] * size + torch.arange(size)).flatten().tolist()


def shares_memory(out: torch.Tensor | None, inputs: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether two elements of ``out`` share a byte, or ``out`` shares one with an input: counted
    byte by byte (the tensors are tiny), independently of the checks under test."""
    if out is None:
        return False
    mine = _element_bytes(out)
    if len(set(mine)) < len(mine):
        return True
    storage = out.untyped_storage().data_ptr()
    return any(
        t is not None and t.untyped_storage().data_ptr() == storage and not set(mine).isdisjoint(_element_bytes(t))
        for t in inputs
    )


def head_strided(tensors: dict[str, torch.Tensor | None]) -> set[str]:
    return {name for name, t in tensors.items() if t is not None and t.stride(-1) != 1}


def scale_offends(scale: Any) -> set[str]:
    return set() if scale is None or abs(scale) <= 1e4 else {"softmax_scale"}


def record(
    figures: dict[str, Counter[str]],
    entry: str,
    call: Callable[[], Any],
    offenders: set[str],
    check: Callable[[Any], str | None],
) -> None:
    """Run ``call``: a refusal must name one of ``offenders``, an acceptance needs none and must pass ``check``."""
    counts = figures[entry]
    counts["examples"] += 1
    try:
        result = call()
    except (TypeError, ValueError) as exc:
        counts["refusals"] += 1
        assert offenders, f"refused a valid call: {type(exc).__name__}({exc!s})"
        assert labels(str(exc)) & offenders, f"{type(exc).__name__}({exc!s}) does not name any of {sorted(offenders)}"
        return
    assert not offenders, f"accepted a call that {sorted(offenders)} make wrong"
    problem = check(result)
    if problem is not None:
        counts["mismatches"] += 1
        pytest.fail(f"mismatch against the reference: {problem}")
    counts["matches"] += 1


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("entry", ["prefill", "decode", "attention"])
@FUZZ_RUNS
@given(data=st.data())
def test_attention_calls_are_served_correctly_or_refused(entry, fault, data, fuzz_figures):
    from tritune.kernels._numerics import compare
    from tritune.kernels.prefill.reference import prefill_reference

    draw = data.draw
    batch, kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    lq = draw(st.integers(1, {"prefill": 4, "decode": 8, "attention": 9}[entry]))
    lkv = draw(st.integers(lq, 9))
    dtype = draw(st.sampled_from([BF, FP]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    names = ("q", "k_cache", "v_cache") if entry == "decode" else ("q", "k", "v")
    layouts = draw_layouts(draw, names, fault)
    shapes = ((batch, kv_heads * group, lq, 64), (batch, kv_heads, lkv, 64), (batch, kv_heads, lkv, 64))
    q, k, v = (laid_out(torch.randn(shape, generator=gen).to(dtype), layouts[name])
               for name, shape in zip(names, shapes, strict=True))  # fmt: skip
    kv_len = None
    if entry == "decode" or draw(st.booleans()):
        kv_len = torch.randint(0, lkv + 1, (batch,), generator=gen, dtype=torch.int32)
    causal = entry == "decode" or draw(st.booleans())
    scale = draw_scale(draw, fault)
    out, k = draw_out(draw, fault, layouts, q, k)

    offenders = scale_offends(scale) | ({"out"} if shares_memory(out, (q, k, v, kv_len)) else set())
    if entry == "decode":
        # Decode never copies a cache: a head dim of stride other than 1 is refused, naming the tensor.
        offenders |= head_strided({"q": q, "k_cache": k, "v_cache": v, "out": out})
    inputs = [t.clone() for t in (q, k, v)]
    if entry == "decode":
        call = lambda: decode_attention(q, k, v, kv_len, softmax_scale=scale, out=out)  # noqa: E731
    else:
        run = prefill_attention if entry == "prefill" else attention
        call = lambda: run(q, k, v, causal=causal, kv_len=kv_len, softmax_scale=scale, out=out)  # noqa: E731

    def check(result: torch.Tensor) -> str | None:
        if out is not None and result is not out:
            return "the result is not the out given"
        expected = prefill_reference(*inputs, causal=causal, kv_len=kv_len, softmax_scale=scale, dtype=torch.float64)
        return compare(result, expected, dtype)

    record(fuzz_figures, "attention" if entry == "attention" else f"{entry}_attention", call, offenders, check)


@pytest.mark.parametrize("fault", FAULTS)
@FUZZ_RUNS
@given(data=st.data())
def test_varlen_calls_are_served_correctly_or_refused(fault, data, fuzz_figures):
    from tritune.kernels import varlen_attention
    from tritune.kernels._numerics import compare
    from tritune.kernels.varlen.reference import varlen_reference

    draw = data.draw
    kv_heads, group, dtype = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([BF, FP]))
    rows, segments = draw(st.integers(2, 8)), draw(st.integers(1, 2))
    cols = segments + draw(st.integers(0, 1))
    table, tokens = [], 0
    for s in range(segments):
        q_len = draw(st.integers(1, min(3, rows)))
        table.append([tokens, q_len, s, draw(st.integers(q_len, rows))])
        tokens += q_len
    info = torch.tensor(table, dtype=torch.int32)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    layouts = draw_layouts(draw, ("q", "k_store", "v_store"), fault)
    q = laid_out(torch.randn(tokens, kv_heads * group, 64, generator=gen).to(dtype), layouts["q"])
    k, v = (laid_out(torch.randn(rows, cols, kv_heads, 64, generator=gen).to(dtype), layouts[name])
            for name in ("k_store", "v_store"))  # fmt: skip
    causal, window = draw(st.booleans()), draw(st.sampled_from([None, 1, 3]))
    scale = draw_scale(draw, fault)
    out, k = draw_out(draw, fault, layouts, q, k)

    # The head dim has stride 1 in every tensor varlen reads or writes (a store is never copied).
    offenders = scale_offends(scale) | head_strided({"q": q, "k_store": k, "v_store": v, "out": out})
    if shares_memory(out, (q, k, v, info)):
        offenders.add("out")
    inputs = [t.clone() for t in (q, k, v)]

    def check(result: torch.Tensor) -> str | None:
        expected = varlen_reference(*inputs, info, causal=causal, window=window, softmax_scale=scale)
        return compare(result, expected, dtype)

    call = lambda: varlen_attention(q, k, v, info, causal=causal, window=window, softmax_scale=scale, out=out)  # noqa: E731
    record(fuzz_figures, "varlen_attention", call, offenders, check)


@pytest.mark.parametrize("fault", ["none", "out", "stride", "any"])
@FUZZ_RUNS
@given(data=st.data())
def test_q4k_calls_are_served_correctly_or_refused(weight, fault, data, fuzz_figures):
    from tritune.kernels.q4k.reference import sqnr_db

    draw = data.draw
    lead = draw(st.sampled_from([(1,), (3,), (2, 2)]))
    dtype = draw(st.sampled_from([BF, FP]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    values = torch.randn((*lead, K), generator=gen).to(dtype)
    # x may take any strides (the op copies one whose K stride is not 1); out must be contiguous.
    x_layout = draw(st.sampled_from(["contiguous", "padded", "inner-strided"]))
    if x_layout == "padded":
        x = torch.empty((*lead, K + 8), dtype=dtype)[..., :K].copy_(values)
    elif x_layout == "inner-strided":
        x = torch.empty((*lead, 2 * K), dtype=dtype)[..., ::2].copy_(values)
    else:
        x = values
    bias_dtype = draw(st.sampled_from([None, BF, torch.float32]))
    bias = None if bias_dtype is None else torch.randn(N, generator=gen).to(bias_dtype)
    shape, size = (*lead, N), math.prod(lead) * N
    bad = {"out": ["zero-stride", "inside-x", "inside-bias"], "stride": ["padded"]}.get(fault, [])
    if fault == "any":
        bad = ["zero-stride", "inside-x", "inside-bias", "padded", "none", "fresh", "beside-x"]
    out_case = draw(st.sampled_from(bad or ["none", "fresh", "beside-x"]))
    out = None
    if out_case == "fresh":
        out = torch.full(shape, float("nan"), dtype=dtype)
    elif out_case == "padded":
        out = torch.empty((*lead, N + 8), dtype=dtype)[..., :N]
    elif out_case == "zero-stride":
        out = torch.empty((*lead[:-1], 1, N), dtype=dtype).expand(shape)
    elif out_case == "inside-x":
        storage = torch.empty(values.numel() + size, dtype=dtype)
        x = storage[: values.numel()].view(values.shape).copy_(values)
        out = storage[values.numel() // 2 : values.numel() // 2 + size].view(shape)
    elif out_case == "inside-bias":
        storage = torch.randn(N + size, generator=gen).to(dtype)
        bias, out = storage[:N], storage[N // 2 : N // 2 + size].view(shape)
    elif out_case == "beside-x":
        storage = torch.empty(values.numel() + size, dtype=dtype)
        x = storage[: values.numel()].view(values.shape).copy_(values)
        out = storage[values.numel() :].view(shape)
    # out must be contiguous (a layout rule, checked before its memory).
    wrong = out is not None and (not out.is_contiguous() or shares_memory(out, (x, bias, *weight.tensors())))
    inputs = (x.clone(), None if bias is None else bias.clone())

    def check(result: torch.Tensor) -> str | None:
        expected = inputs[0].double() @ weight.dequantize().double().t()
        if inputs[1] is not None:
            expected += inputs[1].double()
        sqnr = sqnr_db(result.double(), expected)
        # 25 dB: the floor of the lowest-precision path (fp8 activations) the dispatcher may pick.
        return None if sqnr >= 25.0 else f"SQNR {sqnr:.1f} dB against the fp64 reference"

    record(fuzz_figures, "q4k_linear", lambda: q4k_linear(x, weight, bias, out=out), {"out"} if wrong else set(), check)
