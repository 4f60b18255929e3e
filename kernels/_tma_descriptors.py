"""Host TMA descriptors encoded once per tensor layout, not once per launch.

A kernel that takes host tensor descriptors (the TMA prefill path, the Gluon q4k and prefill
kernels) has Triton 3.6's launcher encode each one with the driver (``cuTensorMapEncodeTiled``,
through ``make_tensordesc_arg``) on every launch, though the 128-byte map depends only on the
tensor's address, shape and strides, the box, the element type and the swizzle. In an eager
decode or prefill loop the same weights and the caching allocator's recycled activations come
back launch after launch, so :func:`cache_encodings` gives a compiled kernel's launcher a wrapper
that keeps the encoded arguments per exact layout (an LRU of :data:`CAPACITY` entries): a hit
launches with the map encoded before, a miss encodes as Triton does.

The wrapper mirrors Triton 3.6's ``wrap_handle_tensordesc`` (what ``_fastlaunch.MIRRORED_TRITON``
names); a launcher not laid out like it is left alone.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tritune.launch")

#: Encoded descriptors kept (each a 128-byte map plus its shape and strides).
CAPACITY = 1024

_ENCODED: OrderedDict[tuple[Any, ...], list[Any]] = OrderedDict()


def forget() -> None:
    """Drop every kept encoding (tests)."""
    _ENCODED.clear()


def cache_encodings(launcher: Any) -> None:
    """Give ``launcher`` (a compiled kernel's ``run``) a tensor-descriptor argument handler that
    reuses encodings; nothing changes for a launcher without host descriptors or with descriptors
    the front end decomposed (no metadata: nothing is encoded at launch)."""
    from triton.backends.nvidia import driver as nvidia

    wrapped = getattr(launcher, "launch", None)
    if wrapped is None or getattr(wrapped, "__tritune_cached__", False):
        return
    try:
        nonlocals = inspect.getclosurevars(wrapped).nonlocals
    except TypeError:  # a builtin: the launcher has no descriptor arguments
        return
    raw, indices, metas = (nonlocals.get(name) for name in ("launcher", "tensordesc_indices", "tensordesc_meta"))
    if raw is None or not indices or not metas or any(meta is None for meta in metas):
        return
    layouts = [_meta_key(meta) for meta in metas]
    launcher.launch = _caching_launch(raw, frozenset(indices), metas, layouts, nvidia)


def _meta_key(meta: dict[str, Any]) -> tuple[Any, ...]:
    """What the encoding reads from the kernel's side: swizzle, element size and type, box, fp4 padding."""
    return (meta["swizzle"], meta["elem_size"], meta["elem_type"], tuple(meta["block_size"]), meta["fp4_padded"])


def _caching_launch(
    raw: Callable[..., Any], indices: frozenset[int], metas: list[Any], layouts: list[Any], nvidia: Any
) -> Callable[..., Any]:
    base = nvidia._BASE_ARGS_FORMAT_LEN
    encode = nvidia.make_tensordesc_arg

    def launch(*args: Any) -> Any:
        final = list(args[:base])
        which = 0
        for position, arg in enumerate(args[base:]):
            if position not in indices:
                final.append(arg)
                continue
            key = (layouts[which], arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), arg.padding)
            encoded = _ENCODED.get(key)
            if encoded is None:
                encoded = _ENCODED[key] = encode(arg, metas[which])
                if len(_ENCODED) > CAPACITY:
                    _ENCODED.popitem(last=False)
            else:
                _ENCODED.move_to_end(key)
            final.extend(encoded)
            which += 1
        return raw(*final)

    launch.__tritune_cached__ = True  # type: ignore[attr-defined]
    return launch
