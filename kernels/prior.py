"""A prior from other GPUs: the winners shipped for the nearest GPUs, at keys this GPU's own bundle lacks.

The rule, in one place:

1. It applies wherever this GPU's shipped bundle (``configs_db/bundles/<slug>.json``) holds no
   winner of the running kernel version at a key: every key on a GPU without a bundle, else the
   keys added after the bundle was made (a layout added to the default grid, an opt-in key tuned
   later). Not at all with ``TRITUNE_DISABLE_BUNDLES=1`` (it is made of bundles) or
   ``TRITUNE_CROSS_GPU=off``.
2. Candidates are the shipped bundles of other GPUs of the same vendor (a bundle's GPU is read from
   its slug, ``<vendor>-<name>-<arch>-<N>sm``). They are ranked by, in order: the architecture's
   distance (compute capability: major versions apart, then minor versions apart), the SM count's
   distance, the peak memory bandwidth's distance where :data:`PEAK_BANDWIDTH_GBPS` knows both
   GPUs (a GPU it does not know ranks after those it knows), then the slug. The nearest
   :data:`PRIOR_GPUS` are used.
3. Each entry of the running kernel version is translated to this GPU: its key's ``arch`` and
   ``sm_count`` are replaced by this GPU's and the key is parsed strictly with the kernel's key
   type; its config is kept only where it parses and is feasible here (the space's
   ``infeasible_reason`` with this GPU's limits).
4. ``TRITUNE_CROSS_GPU=seed`` (the default): the translated configs only seed ``tune``'s search of
   the same key here (:mod:`tritune.tuner.strategy`), nearest GPU first, where they are measured
   like any other trial. ``serve``: they are also served, provisional
   (:attr:`~.winners.Entry.provisional`), at those keys: they enter the winner table before this
   GPU's own bundle and DB, which override them, and a nearer GPU's entry overrides a farther
   one's. Being exact entries, they come before a neighbouring bucket's winner of this GPU: the
   same key on the nearest GPU is the closer guess. The margin is judged on the speedup measured
   on the other GPU.

Nothing here queries the GPU: the running GPU is described by its :class:`~.device.DeviceInfo`,
read once per device, and bandwidth comes from the table below, never from NVML.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass, replace
from typing import Any

from tritune.configs_db import bundles
from tritune.configs_db.records import Rejection, WinnerRecord

from . import settings as settings_module
from .device import DeviceInfo
from .registry import known
from .spec import KernelSpec, TuningKey
from .winners import Entry, admit

log = logging.getLogger("tritune.dispatch")

#: How many of the nearest GPUs' bundles seed (and, with ``serve``, serve) the keys this GPU's bundle lacks.
PRIOR_GPUS = 2

#: Peak memory bandwidth in GB/s from the vendors' datasheets, by the name part of a GPU's slug
#: (``nvidia-h100-80gb-hbm3`` of ``nvidia-h100-80gb-hbm3-sm90-132sm``); the third criterion only.
PEAK_BANDWIDTH_GBPS: dict[str, float] = {
    "nvidia-h200": 4800.0,
    "nvidia-h100-80gb-hbm3": 3350.0,
    "nvidia-h100-nvl": 3900.0,
    "nvidia-h100-pcie": 2000.0,
    "nvidia-a100-sxm4-80gb": 2039.0,
    "nvidia-a100-80gb-pcie": 1935.0,
    "nvidia-a100-sxm4-40gb": 1555.0,
    "nvidia-a100-pcie-40gb": 1555.0,
    "nvidia-l40s": 864.0,
    "nvidia-l4": 300.0,
    "nvidia-a10": 600.0,
    "nvidia-geforce-rtx-4090": 1008.0,
}

_SLUG = re.compile(r"(?P<base>(?P<vendor>[a-z0-9]+)-[a-z0-9-]*?)-(?P<arch>sm\d{2,3}|gfx[0-9a-f]{3,4})-(?P<sms>\d+)sm")


@dataclass(frozen=True)
class Gpu:
    """What the ranking knows of a GPU: from its slug (another GPU's bundle) or its DeviceInfo."""

    slug: str
    vendor: str
    capability: tuple[int, int]
    sm_count: int
    bandwidth_gbps: float | None


def gpu_of_slug(slug: str) -> Gpu | None:
    """The GPU a bundle slug names; ``None`` for a slug not of the form ``<vendor>-<name>-<arch>-<N>sm``."""
    match = _SLUG.fullmatch(slug)
    if match is None:
        return None
    arch = match["arch"]
    if arch.startswith("sm"):
        digits = arch[2:]
        capability = (int(digits[:-1]), int(digits[-1]))
    else:
        digits = arch[3:]
        capability = (int(digits[:-2]), int(digits[-2], 16))
    return Gpu(slug, match["vendor"], capability, int(match["sms"]), PEAK_BANDWIDTH_GBPS.get(match["base"]))


def gpu_of_device(device: DeviceInfo) -> Gpu:
    match = _SLUG.fullmatch(device.slug)
    bandwidth = PEAK_BANDWIDTH_GBPS.get(match["base"]) if match is not None else None
    return Gpu(device.slug, device.vendor, device.capability, device.sm_count, bandwidth)


def distance(here: Gpu, other: Gpu) -> tuple[int, int, int, float, float, str]:
    """The rank of ``other`` as a stand-in for ``here`` (smaller is nearer; see the module docstring)."""
    major = abs(here.capability[0] - other.capability[0])
    minor = abs(here.capability[1] - other.capability[1])
    sms = abs(here.sm_count - other.sm_count)
    if here.bandwidth_gbps is None or other.bandwidth_gbps is None:
        bandwidth = (1.0, 0.0)
    else:
        bandwidth = (0.0, abs(here.bandwidth_gbps - other.bandwidth_gbps))
    return major, minor, sms, *bandwidth, other.slug


def nearest_gpus(device: DeviceInfo, slugs: list[str], limit: int = PRIOR_GPUS) -> list[str]:
    """The ``limit`` slugs of ``slugs`` nearest to ``device``, nearest first; only the same vendor's."""
    here = gpu_of_device(device)
    others = [gpu for slug in slugs if (gpu := gpu_of_slug(slug)) is not None]
    same = [gpu for gpu in others if gpu.vendor == here.vendor and gpu.slug != here.slug]
    return [gpu.slug for gpu in sorted(same, key=lambda gpu: distance(here, gpu))][:limit]


def _allowed(device: DeviceInfo, serving: bool) -> bool:
    """Whether the settings in force let the prior apply on ``device`` (``serving``: to serve, too)."""
    current = settings_module.settings()
    if current.disable_bundles or current.cross_gpu == "off" or (serving and current.cross_gpu != "serve"):
        return False
    return not device.is_interpreter


def active(device: DeviceInfo) -> bool:
    """Whether the prior applies to every key on ``device`` under the settings in force: a GPU
    without a bundle of its own."""
    if not _allowed(device, serving=False):
        return False
    try:
        own = bundles.bundle_path(device.slug)
    except ValueError:
        return False
    return not os.path.lexists(own)


def _own_keys(device: DeviceInfo) -> set[tuple[str, str, str]]:
    """(kernel, kernel version, key as canonical JSON) of every winner this GPU's shipped bundle holds."""
    records, _rejections = shipped_records(device.slug)
    return {_ident(r.kernel, r.kernel_version, r.key) for r in records}


def _ident(kernel: str, version: str, key_dict: dict[str, Any]) -> tuple[str, str, str]:
    return kernel, version, json.dumps(key_dict, sort_keys=True)


def _own_bundle_holds(spec: KernelSpec[Any, Any], key_dict: dict[str, Any], device: DeviceInfo) -> bool:
    """Whether this GPU's shipped bundle holds a winner of ``spec``'s running version at the key."""
    return _ident(spec.name, spec.version, key_dict) in _own_keys(device)


#: GPU slug -> (the file's path, inode, mtime and size when read, what was read): each bundle is parsed
#: once per version of its file, not once per key that asks (``tune`` seeds every key from them).
_parsed: dict[str, tuple[tuple[str, int, int, int], tuple[list[WinnerRecord], list[Rejection]]]] = {}
_parsed_lock = threading.Lock()


def shipped_records(slug: str) -> tuple[list[WinnerRecord], list[Rejection]]:
    """:func:`~tritune.configs_db.bundles.shipped_records`, parsed again only when the file changes
    (another path, inode, modification time or size); the lists are the caller's own."""
    try:
        path = bundles.bundle_path(slug)
        stat = os.stat(path)
    except (ValueError, OSError):  # no such bundle, or no slug: nothing to keep, and the read says why
        return bundles.shipped_records(slug)
    stamp = (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    with _parsed_lock:
        held = _parsed.get(slug)
    if held is None or held[0] != stamp:
        held = (stamp, bundles.shipped_records(slug))
        with _parsed_lock:
            _parsed[slug] = held
    records, rejections = held[1]
    return list(records), list(rejections)


def shipped_slugs() -> list[str]:
    """The GPUs bundles are shipped for."""
    found = []
    for path in sorted(bundles.shipped_bundle_dir().glob("*.json")):
        if bundles.GPU_SLUG.fullmatch(path.stem):
            found.append(path.stem)
    return found


def translate(record: WinnerRecord, device: DeviceInfo) -> WinnerRecord:
    """``record`` as if stored for ``device``: its key's ``arch`` and ``sm_count`` replaced, its source named."""
    key = dict(record.key)
    if "arch" in key:
        key["arch"] = device.arch
    if "sm_count" in key:
        key["sm_count"] = device.sm_count
    return replace(record, gpu=device.slug, key=key, source=f"prior:{record.gpu} {record.source}")


def prior_records(device: DeviceInfo) -> list[tuple[str, list[WinnerRecord]]]:
    """(other GPU, its records translated to ``device``) for the nearest GPUs, nearest first.

    A bundle that cannot be read is skipped (its own GPU reports it); nothing is refused aloud here:
    another GPU's entries that do not fit this one are expected.
    """
    found = []
    for slug in nearest_gpus(device, shipped_slugs()):
        records, rejections = shipped_records(slug)
        for rejection in rejections:
            log.debug("prior from %s: %s", slug, rejection.reason)
        found.append((slug, [translate(record, device) for record in records]))
    return found


def _admitted(record: WinnerRecord, source_gpu: str, device: DeviceInfo) -> tuple[str, TuningKey, Entry] | None:
    if not known(record.kernel):
        return None
    outcome = admit(record, device)
    if isinstance(outcome, Rejection):
        log.debug("prior from %s not used: %s", source_gpu, outcome.reason)
        return None
    kernel, key, entry = outcome
    under = f"{source_gpu}, Triton {record.triton_version}, torch {record.torch_version}"
    return kernel, key, replace(entry, provisional=True, tuned_under=under)


def serving_entries(device: DeviceInfo) -> list[tuple[str, TuningKey, Entry]]:
    """With ``TRITUNE_CROSS_GPU=serve``: the entries other GPUs lend ``device`` at the keys its own
    bundle lacks (every key where it has none), farthest GPU first (a table adding them in order
    keeps the nearest's); ``[]`` where the prior does not apply."""
    if not _allowed(device, serving=True):
        return []
    own = _own_keys(device)
    entries = []
    for slug, records in reversed(prior_records(device)):
        for record in records:
            if _ident(record.kernel, record.kernel_version, record.key) in own:
                continue
            admitted = _admitted(record, slug, device)
            if admitted is not None:
                entries.append(admitted)
    if entries:
        where = "(it has no bundle of its own)" if active(device) else "at keys its own bundle lacks"
        log.info("%s: %d config(s) of other GPUs may serve, provisionally, %s", device.slug, len(entries), where)
    return entries


def seed_configs(spec: KernelSpec[Any, Any], key: TuningKey, device: DeviceInfo) -> list[dict[str, Any]]:
    """Configs the nearest GPUs' bundles hold at ``key`` (translated), feasible here, nearest first, distinct.

    ``[]`` where the prior does not apply (``TRITUNE_CROSS_GPU=off``, this GPU's own bundle holding
    a winner at ``key``, ...): a GPU's bundle seeds the keys it holds, other GPUs' the keys it lacks.
    """
    if not _allowed(device, serving=False):
        return []
    key_dict = key.to_dict()
    if not active(device) and _own_bundle_holds(spec, key_dict, device):
        return []  # this GPU's own winner seeds the key
    limits = spec.limits(device)
    found: list[dict[str, Any]] = []
    for _slug, records in prior_records(device):
        for record in records:
            if record.kernel != spec.name or record.kernel_version != spec.version or record.key != key_dict:
                continue
            try:
                config = spec.space.parse(record.config)
            except (TypeError, ValueError):
                continue
            values = spec.space.to_dict(config)
            if values not in found and spec.space.infeasible_reason(config, key, limits) is None:
                found.append(values)
    return found
