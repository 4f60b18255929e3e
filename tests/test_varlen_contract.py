"""``varlen_attention``'s contract: input checks, ``validate_seq_info``, the registered op, torch.compile.

CPU tier only (the kernels run on the Triton interpreter at tiny shapes); the numerics are in
``test_varlen.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from varlen_cases import HAS_CUDA, NAN, NO_SPLIT, SPLIT, Mix, config_fields, config_of, make_inputs

from tritune.kernels import _launch, validate_seq_info, varlen_attention
from tritune.kernels.varlen import launch as varlen_launch
from tritune.kernels.varlen.kernel import KERNEL
from tritune.kernels.varlen.reference import compare, varlen_reference

# ---- validate_seq_info ---------------------------------------------------------------------------

GOOD_TABLE = [[0, 2, 0, 5], [2, 1, 1, 9], [0, 0, 0, 0]]

SEQ_INFO_ERRORS = [
    pytest.param([[0, 2, 0, 5], [1, 1, 1, 9]], {}, "query ranges overlap", id="overlap"),
    pytest.param([[0, 2, 0, 5], [3, 2, 1, 9]], {}, "leave q's 4 rows", id="q-outside-T"),
    pytest.param([[0, 2, 2, 5]], {}, "column 2 is outside", id="column"),
    pytest.param([[0, 2, 0, 17]], {}, "beyond the flat store's 16 rows", id="kv-end-flat"),
    pytest.param([[0, 3, 0, 2]], {}, "q_len 3 exceeds kv_end 2", id="q-len-over-kv-end"),
    pytest.param([[0, -1, 0, 2]], {}, "q_len is negative", id="negative"),
    pytest.param([[0, 0, 0, -3]], {}, "kv_end is negative", id="negative-unused"),
    pytest.param([[0, 4, 0, 40]], {"rows": 3, "ring": True}, "overwrite each other", id="ring-step-too-long"),
    pytest.param(torch.zeros(2, 4, dtype=torch.int64), {}, "expected dtype torch.int32", id="dtype"),
    pytest.param(torch.zeros(2, 3, dtype=torch.int32), {}, "expected shape", id="shape"),
    pytest.param(torch.zeros(0, 4, dtype=torch.int32), {}, "expected shape", id="empty"),
    pytest.param([1, 2, 3, 4], {}, "expected a torch.Tensor", id="not-a-tensor"),
]


@pytest.mark.parametrize("table, changes, message", SEQ_INFO_ERRORS)
def test_validate_seq_info_errors(table, changes, message):
    if isinstance(table, list) and isinstance(table[0], list):
        table = torch.tensor(table, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        validate_seq_info(table, **{"T": 4, "rows": 16, "cols": 2, **changes})


BAD_ARGUMENTS = [
    pytest.param("T", None, TypeError, "T: expected an int", id="T-none"),
    pytest.param("T", "4", TypeError, "T: expected an int", id="T-str"),
    pytest.param("T", 4.0, TypeError, "T: expected an int", id="T-float"),
    pytest.param("T", -1, ValueError, "T: expected at least 0", id="T-negative"),
    pytest.param("rows", True, TypeError, "rows: expected an int", id="rows-bool"),
    pytest.param("rows", 0, ValueError, "rows: expected at least 1", id="rows-zero"),
    pytest.param("cols", 2.0, TypeError, "cols: expected an int", id="cols-float"),
    pytest.param("cols", -1, ValueError, "cols: expected at least 1", id="cols-negative"),
    pytest.param("ring", 1, TypeError, "ring: expected a bool", id="ring-int"),
]


@pytest.mark.parametrize("name, value, error, message", BAD_ARGUMENTS)
def test_validate_seq_info_names_bad_arguments(name, value, error, message):
    arguments = {"T": 4, "rows": 16, "cols": 2, name: value}
    with pytest.raises(error, match=f"^{message}"):
        validate_seq_info(torch.tensor(GOOD_TABLE, dtype=torch.int32), **arguments)


def test_validate_seq_info_accepts_valid_tables():
    validate_seq_info(torch.tensor(GOOD_TABLE, dtype=torch.int32), T=4, rows=16, cols=2)
    # A ring holds any length; unused slots may hold anything non-negative.
    validate_seq_info(torch.tensor([[0, 3, 1, 500], [9, 0, 7, 3]], dtype=torch.int32), T=3, rows=8, cols=2, ring=True)


# ---- input checks --------------------------------------------------------------------------------


def _valid_args(device: str):
    q, k, v, seq_info = make_inputs(Mix(((0, 2, 0, 5),), tokens=2, rows=8, cols=2, kv_heads=2, group=2),
                                    device=device, tail=0.0)  # fmt: skip
    return {"q": q, "k_store": k, "v_store": v, "seq_info": seq_info}


#: What a window outside the kernels' int32 positions is told.
WINDOW_RANGE = r"window: expected an int in \[1, 2147483647\]"

BAD_INPUTS = [
    pytest.param(lambda a: {**a, "q": a["q"].float()}, TypeError, "q: expected dtype", id="q-dtype"),
    pytest.param(lambda a: {**a, "q": a["q"].tolist()}, TypeError, "q: expected a torch.Tensor", id="q-not-tensor"),
    pytest.param(lambda a: {**a, "q": a["q"][None]}, ValueError, r"q: expected shape \[T, Hq, D\].*4 dims",
                 id="q-rank"),
    pytest.param(lambda a: {**a, "k_store": a["k_store"].bfloat16()}, TypeError, "k_store: expected dtype",
                 id="k-dtype"),
    pytest.param(lambda a: {**a, "v_store": a["v_store"][:4]}, ValueError,
                 "v_store: expected shape .*rows is 4 where k_store has rows=8", id="v-shape"),
    pytest.param(lambda a: {**a, "k_store": a["k_store"][0]}, ValueError, "k_store: expected shape .*3 dims",
                 id="k-rank"),
    pytest.param(lambda a: {**a, "k_store": a["k_store"][:0], "v_store": a["v_store"][:0]}, ValueError,
                 "at least one row", id="empty-store"),
    pytest.param(lambda a: {**a, "q": a["q"][:, :3]}, ValueError, "not a multiple of", id="gqa-divisibility"),
    pytest.param(lambda a: {**a, "q": a["q"][..., :48], "k_store": a["k_store"][..., :48],
                            "v_store": a["v_store"][..., :48]}, ValueError, "head dim 48", id="head-dim"),
    pytest.param(lambda a: {**a, "k_store": a["k_store"][..., :32], "v_store": a["v_store"][..., :32]}, ValueError,
                 "k_store: expected shape .*D is 32 where q has D=64", id="kv-head-dim"),
    pytest.param(lambda a: {**a, "seq_info": a["seq_info"].long()}, TypeError, "seq_info: expected dtype torch.int32",
                 id="seq-info-dtype"),
    pytest.param(lambda a: {**a, "seq_info": a["seq_info"][:, :3]}, ValueError, r"seq_info: expected shape \[S, 4\]",
                 id="seq-info-shape"),
    pytest.param(lambda a: {**a, "seq_info": a["seq_info"][:0]}, ValueError,
                 r"seq_info: expected shape \[S, 4\] with S >= 1", id="seq-info-empty"),
    pytest.param(lambda a: {**a, "k_store": a["k_store"][:, :, :0], "v_store": a["v_store"][:, :, :0]}, ValueError,
                 "q: 4 query heads are not a multiple of k_store's 0 KV heads", id="no-kv-heads"),
    pytest.param(lambda a: {**a, "seq_info": a["seq_info"][0]}, ValueError, r"seq_info: expected shape \[S, 4\]",
                 id="seq-info-rank"),
    pytest.param(lambda a: {**a, "seq_info": a["seq_info"].to("meta")}, ValueError, "seq_info: expected device",
                 id="seq-info-device"),
    pytest.param(lambda a: {**a, "k_store": a["k_store"].to("meta")}, ValueError, "k_store: expected device",
                 id="k-device"),
    pytest.param(lambda a: {**a, "v_store": a["v_store"].transpose(2, 3).contiguous().transpose(2, 3)},
                 ValueError, "v_store: the last dim must be contiguous", id="v-inner-stride"),
    pytest.param(lambda a: {**a, "window": 0}, ValueError, WINDOW_RANGE, id="window-zero"),
    pytest.param(lambda a: {**a, "window": -4}, ValueError, WINDOW_RANGE, id="window-negative"),
    pytest.param(lambda a: {**a, "window": 2**63}, ValueError, WINDOW_RANGE, id="window-huge"),
    pytest.param(lambda a: {**a, "window": 2.5}, TypeError, "window: expected an int or None", id="window-float"),
    pytest.param(lambda a: {**a, "causal": 1}, TypeError, "causal: expected a bool", id="causal-type"),
    pytest.param(lambda a: {**a, "ring": "yes"}, TypeError, "ring: expected a bool", id="ring-type"),
    pytest.param(lambda a: {**a, "out": torch.empty_like(a["q"]).float()}, TypeError, "out: expected dtype",
                 id="out-dtype"),
    pytest.param(lambda a: {**a, "out": torch.empty_like(a["q"])[:1]}, ValueError, r"out: expected shape \(2, 4, 64\)",
                 id="out-shape"),
    pytest.param(lambda a: {**a, "softmax_scale": "0.1"}, TypeError, "softmax_scale", id="scale-type"),
    pytest.param(lambda a: {**a, "softmax_scale": math.nan}, ValueError,
                 r"softmax_scale: expected a number with \|softmax_scale\| <= 10000", id="scale-nan"),
    pytest.param(lambda a: {**a, "softmax_scale": -math.inf}, ValueError,
                 r"softmax_scale: expected a number with \|softmax_scale\| <= 10000", id="scale-inf"),
    pytest.param(lambda a: {k: t.to("meta") for k, t in a.items()}, ValueError, "q: expected a CUDA tensor",
                 id="all-meta"),
]  # fmt: skip


@pytest.mark.parametrize("mutate, error, message", BAD_INPUTS)
def test_bad_inputs_name_the_argument(mutate, error, message, device):
    args = mutate(_valid_args(device))
    with pytest.raises(error, match=message):
        varlen_attention(args.pop("q"), args.pop("k_store"), args.pop("v_store"), args.pop("seq_info"), **args)


def test_empty_step_returns_out(device):
    args = _valid_args(device)
    q = args["q"][:0]
    assert varlen_attention(q, args["k_store"], args["v_store"], args["seq_info"]).shape == q.shape


# ---- torch.library integration -------------------------------------------------------------------


def test_direct_launch_and_registered_op_agree(monkeypatch, device):
    if device == "cpu":
        # Plan as if the interpreter had 4 SMs, so that the split kernel and the merge both run.
        monkeypatch.setitem(_launch.SM_COUNTS, torch.device("cpu"), 4)
    mix = Mix(((0, 3, 0, 40), (3, 1, 1, 37)), tokens=4, rows=40, cols=2, group=2)
    q, k, v, seq_info = make_inputs(mix)
    direct, through_op = torch.full_like(q, NAN), torch.full_like(q, NAN)
    KERNEL.launch(config_of(SPLIT), q, k, v, seq_info, softmax_scale=0.125, out=direct)
    torch.ops.tritune.varlen_attention(q, k, v, seq_info, True, None, False, 0.125, through_op, **config_fields(SPLIT))
    assert compare(direct, varlen_reference(q, k, v, seq_info, softmax_scale=0.125), q.dtype) is None
    assert torch.equal(direct, through_op)


def test_opcheck():
    mix = Mix(((0, 2, 0, 9), (2, 1, 1, 4)), tokens=4, rows=12, cols=2, group=2)
    q, k, v, seq_info = make_inputs(mix, tail=0.0)
    q = torch.nan_to_num(q)
    assert KERNEL.op is torch.ops.tritune.varlen_attention.default
    for window in (None, 3):
        torch.library.opcheck(
            KERNEL.op, (q, k, v, seq_info, True, window, False, 0.125, torch.empty_like(q)), config_fields(NO_SPLIT)
        )


def test_torch_compile_fullgraph():
    mix = Mix(((0, 2, 0, 9), (2, 1, 1, 4)), tokens=3, rows=12, cols=2, group=2)
    q, k, v, seq_info = make_inputs(mix)

    def step(q, k, v, seq_info, out):
        return varlen_attention(q, k, v, seq_info, window=4, out=out) * 2.0

    backend = "inductor" if HAS_CUDA else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out = torch.full_like(q, NAN)
    result = compiled(q, k, v, seq_info, out)
    assert compare(out, varlen_reference(q, k, v, seq_info, window=4), q.dtype) is None
    torch.testing.assert_close(result, out * 2.0, atol=0, rtol=0)
    torch.testing.assert_close(result, step(q, k, v, seq_info, torch.full_like(q, NAN)), atol=0, rtol=0)


def test_torch_compile_dynamic_width_compiles_once():
    """A symbolic T reaches neither the key nor a guard: two widths share one compiled graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def step(q, k, v, seq_info):
        return varlen_attention(q, k, v, seq_info) + 1.0

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for tokens in (5, 9):
        mix = Mix(((0, 2, 0, 9), (2, 1, 1, 4)), tokens=tokens, rows=12, cols=2, group=2)
        q, k, v, seq_info = make_inputs(mix)
        torch.testing.assert_close(compiled(q, k, v, seq_info), step(q, k, v, seq_info), atol=0, rtol=0)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="GPU tier: needs a CUDA GPU (run on the H200)")
def test_torch_compile_with_kv_tma_pinned_keeps_pointer_loads(monkeypatch):
    """Inductor traces the op's body with wrap_triton on: a pinned KV_TMA config must build no host
    descriptor there (torch would bake it into the graph) and still give the right result."""
    from tritune.kernels.pins import use_config

    built = []
    real = varlen_launch.unchecked_descriptor
    monkeypatch.setattr(varlen_launch, "unchecked_descriptor", lambda t, box: built.append(box) or real(t, box))
    mix = Mix(((0, 1, 0, 300), (1, 40, 2, 200), (41, 3, 1, 257)), tokens=48, rows=320, cols=3, kv_heads=2, group=4,
              head_dim=128, dtype=torch.bfloat16)  # fmt: skip
    q, k, v, seq_info = make_inputs(mix, tail=0.0)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "SHORT_M": 16, "KV_TMA": True}
    torch._dynamo.reset()

    def step(q, k, v, seq_info, out):
        return varlen_attention(q, k, v, seq_info, out=out) * 2.0

    out = torch.full_like(q, NAN)
    with use_config("varlen_sdpa", config):
        result = torch.compile(step, fullgraph=True)(q, k, v, seq_info, out)
    assert not built
    assert compare(out, varlen_reference(q, k, v, seq_info), q.dtype) is None
    torch.testing.assert_close(result, out * 2.0, atol=0, rtol=0)
