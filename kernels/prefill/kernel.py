"""Prefill attention: the ``tma_prefill`` declaration, its path choice and ``prefill_attention``.

Three paths serve one contract (see :mod:`.reference`): the portable kernel (any CUDA GPU), the
TMA kernel (SM90+, causal, 16-byte aligned layouts, head dims 64/128/256) and the warp-specialized
Gluon kernel ``ws`` (SM90 only, causal or not, the TMA layouts, head dims 64/128). The dispatcher
picks a config per key; :func:`serve` then makes sure the chosen path may serve the call,
honouring ``settings().enable_tma_causal_prefill``. The op is ``tritune::prefill_attention``; the
TMA and ws paths run inside nested opaque ops (:mod:`.launch`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tritune.search_spaces.base import TargetLimits
from tritune.search_spaces.tma_prefill import (
    HEAD_DIMS,
    SPACE,
    TMA_HEAD_DIMS,
    WS_HEAD_DIMS,
    PortableConfig,
    PrefillConfig,
    TmaConfig,
    WsConfig,
    grid_programs,
    pack_gqa_applies,
)

from .. import settings as settings_module
from .._launch import SOFTMAX_SCALE, gqa_rule
from ..declare import Derived, Kernel, Output, Rule, Scalar, Tensor
from ..device import DeviceInfo, device_info, target_supports
from ..fit_default import fit_shared_memory, halve_first
from ..spec import Replaced, TuningKey, pow2_bucket
from ._gluon_ws import CONSUMER_WARPS, _prefill_ws_kernel
from ._triton_portable import _prefill_fwd_kernel
from ._triton_tma import _merge_splits_kernel, _prefill_tma_kernel
from .launch import launch
from .reference import prefill_reference

__all__ = [
    "KERNEL",
    "PrefillKey",
    "default_config",
    "pinned_config",
    "prefill_attention",
    "serve",
    "tma_default",
    "tma_layout_ok",
    "ws_default",
    "ws_fallback_reason",
]

log = logging.getLogger("tritune.prefill")

#: The portable default for head dim 256 (64 x 64 tiles of that width crowd 99 KiB parts).
_PORTABLE_D256 = PortableConfig(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
_PORTABLE_INTERPRETER = PortableConfig(BLOCK_M=32, BLOCK_N=32)
_TMA_DEFAULT = TmaConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
_TMA_D256 = TmaConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
_TMA_INTERPRETER = TmaConfig(BLOCK_M=32, BLOCK_N=32)
# The ws path at head dim 128: 128 x 128 tiles, two stages (three fit 227 KB but leave no room to
# grow), and 40 producer registers (24 spill zeroing V's tail). At 64: three stages and 24 suffice.
_WS_D128 = WsConfig(BLOCK_M=128, BLOCK_N=128, num_stages=2, CONSUMER_REGS=232, PRODUCER_REGS=40)
#: The ws grid is (query head, batch, M tile): CUDA caps its z extent (a launch chunks batches).
_GRID_YZ = 65535
_WS_D64 = WsConfig(BLOCK_M=128, BLOCK_N=128, num_stages=3, CONSUMER_REGS=240, PRODUCER_REGS=24)

_warned_targets: set[str] = set()
_is_compiling = torch.compiler.is_compiling


@dataclass(frozen=True)
class PrefillKey(TuningKey):
    dtype: str
    head_dim: int
    gqa_group: int
    causal: bool
    lq_bucket: int
    lkv_bucket: int

    BUCKETS: ClassVar[tuple[str, ...]] = ("lq_bucket", "lkv_bucket")


def tma_layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether tensor descriptors may cover q, k, v and out (2-byte elements): what ``TensorDescriptor`` asserts.

    Unit inner strides, every other stride a multiple of 8 elements (16 bytes; OR-ing them keeps
    any low bit), no empty dimension, 16-byte aligned bases. Runs on every call, hence the plain
    arithmetic. Traced tensors (``torch.compile``, ``make_fx``, fake tensors, ``vmap``) have no data
    pointers: the TMA op's body checks the bases again at run time.
    """
    sq0, sq1, sq2, sq3 = q.stride()
    sk0, sk1, sk2, sk3 = k.stride()
    sv0, sv1, sv2, sv3 = v.stride()
    so0, so1, so2, so3 = out.stride()
    if (
        sq3 != 1
        or sk3 != 1
        or sv3 != 1
        or so3 != 1
        or (sq0 | sq1 | sq2 | sk0 | sk1 | sk2 | sv0 | sv1 | sv2 | so0 | so1 | so2) & 7
    ):
        return False
    # v has k's shape, out has q's.
    if 0 in q.shape or 0 in k.shape:
        return False
    if _is_compiling():
        return True  # traced tensors have no addresses: the TMA op's body checks them at run time
    if not (type(q) is type(k) is type(v) is type(out) is torch.Tensor) and _any_fake(q, k, v, out):
        return True  # nor fake ones (their data_ptr() is a deprecated 0, with a warning)
    try:
        # Subclasses with storage (nn.Parameter) are checked like plain tensors.
        return not (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & 15
    except RuntimeError:  # functional and functorch-wrapped tensors (vmap) have none either
        return True


def _any_fake(*tensors: torch.Tensor) -> bool:
    return any(isinstance(t, FakeTensor) for t in tensors)


def _key(device: DeviceInfo, f: Any) -> PrefillKey:
    return PrefillKey(
        arch=device.arch,
        sm_count=device.sm_count,
        dtype=f.dtype,
        head_dim=f.D,
        gqa_group=f.Hq // max(f.Hkv, 1),
        causal=f.causal,
        lq_bucket=pow2_bucket(f.Lq),
        lkv_bucket=pow2_bucket(f.Lkv),
    )


# ---- defaults, pins and the path a call is served by -------------------------------------------


def default_config(key: PrefillKey) -> PortableConfig:
    """The portable default: 64 x 64 tiles, 4 warps, 2 stages (64 x 32, 1 stage at head dim 256),
    with fewer stages, then narrower KV tiles and then fewer query rows, where a block of the GPU
    the key names has less shared memory than these need (Turing's 64 KiB: one stage at head dim
    128; Pascal's 48 KiB)."""
    if key.arch == "cpu-interpreter":
        return _PORTABLE_INTERPRETER
    chosen = _PORTABLE_D256 if key.head_dim > 128 else PortableConfig()
    return fit_shared_memory(chosen, key, SPACE, halve_first("BLOCK_N", "BLOCK_M"))


def tma_default(key: PrefillKey) -> TmaConfig:
    """The TMA path's default for ``key`` (served by ``enable_tma_causal_prefill=on``)."""
    if key.arch == "cpu-interpreter":
        return _TMA_INTERPRETER
    return _TMA_D256 if key.head_dim > 128 else _TMA_DEFAULT


def ws_default(key: PrefillKey) -> WsConfig:
    """The ws path's starting config for ``key`` (head dim 64 or 128; SM90 only)."""
    return _WS_D64 if key.head_dim <= 64 else _WS_D128


def pinned_config(values: Mapping[str, Any]) -> PrefillConfig:
    """A ``use_config`` dict: fields left out take the defaults of the path it names."""
    if isinstance(values, Mapping) and values.get("path") == "tma":
        return SPACE.parse(values, base=_TMA_DEFAULT)
    if isinstance(values, Mapping) and values.get("path") == "ws":
        return SPACE.parse(values, base=_WS_D128)
    return SPACE.parse(values)


@functools.lru_cache(maxsize=256)
def portable_for(config: TmaConfig | WsConfig, key: PrefillKey, limits: TargetLimits) -> PortableConfig:
    """The portable config standing in for a TMA or ws one: same tiles if they fit, else the default.

    A ws config's stand-in takes the warps of one of its consumer warpgroups.
    """
    num_warps = CONSUMER_WARPS.value if isinstance(config, WsConfig) else config.num_warps
    candidate = PortableConfig(
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, num_warps=num_warps, num_stages=config.num_stages
    )
    if SPACE.infeasible_reason(candidate, key, limits) is None:
        return candidate
    return default_config(key)


def portable_stand_in(
    config: TmaConfig | WsConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    out: torch.Tensor,
) -> PortableConfig:
    """:func:`portable_for` a TMA or ws config at a call's key (the TMA op's body, on a misaligned base)."""
    device = device_info(q.device)
    facts = KERNEL.facts(q, k, v, kv_len, causal, softmax_scale, out)
    return portable_for(config, KERNEL.key_for(device, facts), KERNEL.limits(device))


def ws_fallback_reason(device: DeviceInfo, f: Any, block_m: int = _WS_D128.BLOCK_M) -> str | None:
    """Why the ws path may not serve a call with facts ``f`` on ``device`` in M tiles of ``block_m``
    rows, or ``None`` if it may.

    The ws kernel is Gluon built for sm_90a (wgmma, setmaxnreg): the interpreter cannot run
    Gluon, and other architectures lack those instructions. Its tiles move through the same
    tensor descriptors as the TMA path's, so the same layout fact gates it; causal and
    non-causal calls, GQA and device ``kv_len`` are all served, any number of batches (the launch
    takes at most 65535 at a time, CUDA's cap on the grid's y extent).
    """
    if settings_module.settings().enable_tma_causal_prefill == "off":
        return "enable_tma_causal_prefill=off turns off every descriptor (TMA) path, ws included"
    if device.is_interpreter:
        return "the interpreter cannot run Gluon kernels: the TMA or portable path serves"
    if device.capability != (9, 0) or not target_supports(device, (9, 0)):
        return f"the ws path runs on SM90 (Hopper) only, not {device.arch}"
    if f.D not in WS_HEAD_DIMS:
        return f"the ws path covers head dims {WS_HEAD_DIMS}, not {f.D}"
    if not f.tma_layout_ok:
        return "q, k, v or out cannot be covered by tensor descriptors (strides or bases not 16-byte aligned)"
    if -(-f.Lq // block_m) > _GRID_YZ:
        return f"the ws grid holds at most {_GRID_YZ} M tiles of {block_m} rows"
    return None


def _ws_stand_in(device: DeviceInfo, f: Any) -> TmaConfig | PortableConfig:
    """What serves a call a ws config may not: the TMA default where it fits the key, else the portable default."""
    key = _key(device, f)
    forced = tma_default(key)
    if SPACE.infeasible_reason(forced, key, KERNEL.limits(device)) is None:
        return forced
    return default_config(key)


@functools.lru_cache(maxsize=256)
def _infeasible(config: PrefillConfig, key: PrefillKey, limits: TargetLimits) -> str | None:
    """``SPACE.infeasible_reason``, remembered: :func:`serve` asks it of every config it serves."""
    reason: str | None = SPACE.infeasible_reason(config, key, limits)
    return reason


def _feasible_stand_in(config: PrefillConfig, key: PrefillKey, limits: TargetLimits) -> PrefillConfig:
    """What serves in place of ``config``, infeasible at ``key``: for a TMA config (its path may
    serve the call) the TMA default where it fits, else the portable config :func:`portable_for`
    picks; for a portable one the portable default."""
    if isinstance(config, TmaConfig):
        forced = tma_default(key)
        if forced != config and _infeasible(forced, key, limits) is None:
            return forced
        return portable_for(config, key, limits)
    return default_config(key)


def serve(config: PrefillConfig, device: DeviceInfo, f: Any) -> PrefillConfig | Replaced:
    """Serve ``config`` if its path may run this call, else its stand-in (a :class:`Replaced`
    naming why, where there is a reason to give).

    ``enable_tma_causal_prefill``: ``auto`` keeps the selected config where eligible; ``on``
    serves a TMA config (the selected one, else the TMA default) wherever eligible and warns
    once per device when the target cannot run it; ``off`` never serves TMA (nor ws). A ws
    config serves where :func:`ws_fallback_reason` finds nothing against it, else the TMA default
    stands in (then checked like any TMA config: the portable path where TMA may not serve).

    On a GPU, a config the space finds infeasible for the call's key (a ``use_config`` pin: the
    dispatcher serves only feasible winners and defaults) gives way too: a ws config to the same
    stand-in, a TMA config to the TMA default, or the portable path where that does not fit
    either, a portable config to the portable default. Its tiles would not build or would spill.
    On the interpreter, whose limits bound only what the tuner sweeps, a pin runs as given.
    Runs once per call's facts (the dispatcher remembers what it served), the feasibility rule
    once per config and key.
    """
    why = None
    if config.path == "ws":
        why = ws_fallback_reason(device, f, config.BLOCK_M)
        if why is None:
            # ws_fallback_reason found an SM90 GPU: the space's rule decides the rest.
            why = _infeasible(config, _key(device, f), KERNEL.limits(device))
            if why is None:
                return config
        config = _ws_stand_in(device, f)
    served = _serve_path(config, device, f)
    if not device.is_interpreter:
        key, limits = _key(device, f), KERNEL.limits(device)
        infeasible = _infeasible(served, key, limits)
        if infeasible is not None:
            why = why or infeasible
            served = _feasible_stand_in(served, key, limits)
    return served if why is None else Replaced(served, why)


def _serve_path(config: TmaConfig | PortableConfig, device: DeviceInfo, f: Any) -> PrefillConfig:
    """:func:`serve` for a TMA or portable config: the TMA setting, the TMA path's eligibility and its
    per-call repairs (a packing the group cannot take, a split the call's grid does not need)."""
    mode = settings_module.settings().enable_tma_causal_prefill
    wants_tma = config.path == "tma" if mode == "auto" else mode == "on"
    if not wants_tma and config.path != "tma":
        return config
    if wants_tma and _tma_target(device, warn=mode == "on") and f.causal and f.tma_layout_ok and f.D in TMA_HEAD_DIMS:
        if config.path != "tma":
            key = _key(device, f)
            forced = tma_default(key)
            if SPACE.infeasible_reason(forced, key, KERNEL.limits(device)) is not None:
                # The TMA default's tiles do not fit this GPU (e.g. 99 KB of shared memory).
                return config
            config = forced
        group = f.Hq // f.Hkv
        if config.PACK_GQA and not pack_gqa_applies(config, group):
            config = dataclasses.replace(config, PACK_GQA=False)
        # A split tuned for one head count must not blow up the workspace of a call whose grid
        # already fills the GPU (keys do not hold batch or heads).
        if (
            config.SPLIT_KV > 1
            and not device.is_interpreter
            and grid_programs(config, group, f.Lq, f.Hq, f.B) >= 2 * device.sm_count
        ):
            config = dataclasses.replace(config, SPLIT_KV=1)
        return config
    if config.path == "tma":
        return portable_for(config, _key(device, f), KERNEL.limits(device))
    return config


def _tma_target(device: DeviceInfo, *, warn: bool) -> bool:
    # The interpreter runs tensor descriptors too: that is how the CPU tier covers the path.
    if device.is_interpreter or target_supports(device, (9, 0)):
        return True
    if warn and device.slug not in _warned_targets:
        _warned_targets.add(device.slug)
        log.warning(
            "TRITUNE_ENABLE_TMA_CAUSAL_PREFILL=on, but %s (%s) cannot run the TMA path (it needs SM90+, "
            "and every architecture in TORCH_CUDA_ARCH_LIST SM90+): serving the portable path",
            device.name,
            device.arch,
        )
    return False


# ---- the declaration ---------------------------------------------------------------------------

KERNEL = Kernel(
    "tma_prefill",
    arguments=[
        Tensor("q", ("B", "Hq", "Lq", "D"), dtypes=(torch.bfloat16, torch.float16)),
        Tensor("k", ("B", "Hkv", "Lkv", "D"), dtype_of="q"),
        Tensor("v", ("B", "Hkv", "Lkv", "D"), dtype_of="q"),
        Tensor("kv_len", shapes=((), ("B",)), dtypes=(torch.int32,), optional=True),
        Scalar("causal", bool, default=True),
        SOFTMAX_SCALE,
        Output("out", like="q", keep_layout=True),
    ],
    rules=[
        Rule("q", lambda D: D in HEAD_DIMS, f"head dim {{D}} is not supported; expected one of {HEAD_DIMS}"),
        gqa_rule("k"),
    ],
    derived=[Derived("tma_layout_ok", tma_layout_ok)],
    facts=("dtype", "B", "Hq", "Hkv", "Lq", "Lkv", "D", "causal", "has_kv_len", "tma_layout_ok"),
    space=SPACE,
    key_type=PrefillKey,
    key=_key,
    launch=launch,
    reference=prefill_reference,
    jit_kernels=(_prefill_fwd_kernel, _prefill_tma_kernel, _merge_splits_kernel, _prefill_ws_kernel),
    # Trials are timed as CUDA-graph replays with the L2 flushed (the tuning half's launch_bound).
    protocol=1,
    default=default_config,
    pin=pinned_config,
    serve=serve,
    tuning="tritune.kernels.prefill.tuning:TUNING",
    op_name="tritune::prefill_attention",
)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    kv_len: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over ``k, v [B, Hkv, Lkv, D]`` (bf16/fp16, any strides).

    ``Hq`` must be a multiple of ``Hkv`` (GQA) and ``D`` one of 64, 80, 96, 128, 256.
    ``kv_len`` (int32 on q's device, shape ``[]`` or ``[B]``) bounds the valid keys and is read on
    the device, so a call can be captured in a CUDA graph and replayed with new lengths; it is
    clamped to ``[0, Lkv]``. With ``causal``, query ``i`` sits at position ``kv_len - Lq + i``
    and sees the keys at positions up to its own (bottom-right alignment). Rows that see no key
    are zeros. ``softmax_scale`` defaults to ``1 / sqrt(D)``; any finite scale with
    ``|softmax_scale| <= 1e4`` is served, zero and negative ones included. The result is written to
    ``out`` (default ``torch.empty_like(q)``) through its strides and returned; ``out`` must not
    share memory with q, k, v or kv_len, nor two of its elements one address.
    """
    return KERNEL.call(q, k, v, kv_len, causal, softmax_scale, out)  # type: ignore[no-any-return]
