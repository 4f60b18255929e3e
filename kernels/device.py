"""Which GPU a call runs on, and which architectures the build targets.

Identification prefers NVML (``pynvml``): it names the GPU, its compute capability and its core
count without creating a CUDA context, which matters for the ``tune`` CLI and for processes that
only want to know what they would run on. torch is the fallback (and the only source on ROCm).
Without a GPU the pseudo-device ``cpu-interpreter`` stands for the Triton interpreter; its
configs are stored under that name and never serve a GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass

import torch

log = logging.getLogger("tritune.device")

CPU_INTERPRETER = "cpu-interpreter"

# CUDA cores per multiprocessor by compute-capability major (and minor where it differs), used
# to turn NVML's core count into an SM count.
_CORES_PER_SM = {(6, 0): 64, (7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128}
_CORES_PER_SM_BY_MAJOR = {6: 128, 7: 64, 8: 128, 9: 128, 10: 128, 11: 128, 12: 128}


@dataclass(frozen=True)
class DeviceInfo:
    """What tuning keys and bundle names need to know about one device."""

    name: str
    vendor: str  # "nvidia", "amd" or "cpu"
    capability: tuple[int, int]  # (0, 0) for the interpreter
    sm_count: int
    arch: str  # "sm90", "gfx942", or "cpu-interpreter"
    driver: str = ""
    cuda: str = ""

    @property
    def is_interpreter(self) -> bool:
        return self.vendor == "cpu"

    @property
    def is_rocm(self) -> bool:
        return self.vendor == "amd"

    @property
    def slug(self) -> str:
        """File-name form used for bundles, e.g. ``nvidia-h200-sm90-132sm``."""
        if self.is_interpreter:
            return CPU_INTERPRETER
        base = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        if not base.startswith(self.vendor):
            base = f"{self.vendor}-{base}"
        return f"{base}-{self.arch}-{self.sm_count}sm"


def interpreter_device() -> DeviceInfo:
    return DeviceInfo(name=CPU_INTERPRETER, vendor="cpu", capability=(0, 0), sm_count=1, arch=CPU_INTERPRETER)


def make_current(device: torch.device) -> torch.cuda.device | None:
    """A context that makes CUDA ``device`` the current device, or None where it already is (or
    ``device`` is not a CUDA device with an index).

    Triton launches on the current device and its stream, where torch's own ops run on their
    tensors' device: a call whose tensors sit on another GPU than the current one (a model spread
    over the GPUs of one process, as ``device_map`` loaders place it) runs under this context.
    """
    index = device.index
    # While torch.compile traces: Inductor's generated code enters its own device guard per device.
    if index is None or device.type != "cuda" or torch.compiler.is_compiling():
        return None
    return None if index == torch.cuda.current_device() else torch.cuda.device(index)


def _cuda_index(device: torch.device | int | str | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _nvml_index(cuda_index: int) -> int | str:
    """Map a CUDA ordinal to an NVML index or UUID through CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return cuda_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if cuda_index >= len(entries):
        raise ValueError(f"device {cuda_index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[cuda_index]
    return int(entry) if entry.isdigit() else entry


def _from_nvml(cuda_index: int) -> DeviceInfo | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # NVML missing or no driver: torch will answer
        log.debug("NVML unavailable (%s); identifying the GPU through torch", exc)
        return None
    try:
        target = _nvml_index(cuda_index)
        if isinstance(target, int):
            handle = pynvml.nvmlDeviceGetHandleByIndex(target)
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(target)
        try:
            mig_current, _ = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError:
            mig_current = 0
        if mig_current:
            # A MIG slice has fewer SMs than the parent GPU NVML describes.
            return None
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        cores = pynvml.nvmlDeviceGetNumGpuCores(handle)
        per_sm = _CORES_PER_SM.get((major, minor), _CORES_PER_SM_BY_MAJOR.get(major, 128))
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        return DeviceInfo(
            name=name,
            vendor="nvidia",
            capability=(int(major), int(minor)),
            sm_count=int(cores) // per_sm,
            arch=f"sm{major}{minor}",
            driver=driver,
            cuda=str(torch.version.cuda or ""),
        )
    except Exception as exc:
        log.debug("NVML could not describe device %s (%s); using torch", cuda_index, exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            log.debug("NVML shutdown failed", exc_info=True)


def _nvml_driver_version() -> str:
    """The driver version through NVML (a system query: no device numbering involved)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return ""
    return version.decode() if isinstance(version, bytes) else str(version)


def _from_torch(cuda_index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(cuda_index)
    if torch.version.hip:
        arch = str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
        return DeviceInfo(
            name=props.name,
            vendor="amd",
            capability=(props.major, props.minor),
            sm_count=props.multi_processor_count,
            arch=arch,
            cuda=str(torch.version.hip),
        )
    return DeviceInfo(
        name=props.name,
        vendor="nvidia",
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        arch=f"sm{props.major}{props.minor}",
        driver=_nvml_driver_version(),
        cuda=str(torch.version.cuda or ""),
    )


def _nvml_order_is_cuda_order() -> bool:
    """NVML numbers GPUs in PCI bus order, CUDA fastest first unless told otherwise."""
    if os.environ.get("CUDA_DEVICE_ORDER", "").strip().upper() == "PCI_BUS_ID":
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([e for e in visible.split(",") if e.strip()]) == 1:
        return True
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()) == 1
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


@functools.lru_cache(maxsize=64)
def _identify_cuda(cuda_index: int) -> DeviceInfo:
    # Once CUDA is up (any call with GPU tensors), torch answers exactly and for free. Before
    # that (the CLI, a process that only asks), NVML avoids creating a context, but only where
    # its numbering provably matches CUDA's.
    use_nvml = not torch.version.hip and not torch.cuda.is_initialized() and _nvml_order_is_cuda_order()
    info = _from_nvml(cuda_index) if use_nvml else None
    return info if info is not None else _from_torch(cuda_index)


def device_info(device: torch.device | int | str | None = None) -> DeviceInfo:
    """Describe the device a tensor lives on (``cpu`` means the Triton interpreter)."""
    if isinstance(device, torch.device | str) and torch.device(device).type == "cpu":
        return interpreter_device()
    return _identify_cuda(_cuda_index(device))


def parse_arch_list(value: str) -> list[tuple[int, int]]:
    """Parse ``TORCH_CUDA_ARCH_LIST`` forms: ``8.0;9.0``, ``9.0a``, ``sm_90``, ``9.0+PTX``, ``90``."""
    archs: list[tuple[int, int]] = []
    for raw in re.split(r"[;,\s]+", value.strip()):
        if not raw:
            continue
        token = raw.lower().removesuffix("+ptx")
        token = token.removeprefix("sm_").removeprefix("compute_")
        match = re.fullmatch(r"(\d+)\.(\d+)[af]?|(\d+)(\d)[af]?", token)
        if match is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {raw!r} is not an architecture such as 9.0, 9.0a or sm_90")
        if match.group(1) is not None:
            archs.append((int(match.group(1)), int(match.group(2))))
        else:
            archs.append((int(match.group(3)), int(match.group(4))))
    return archs


def target_supports(device: DeviceInfo, minimum: tuple[int, int]) -> bool:
    """Whether code needing ``minimum`` compute capability may run for this device and build.

    ROCm never qualifies for NVIDIA-only paths. When ``TORCH_CUDA_ARCH_LIST`` is set, every
    listed architecture must qualify too: a build that also targets older GPUs must not bake in
    instructions they lack.
    """
    if device.vendor != "nvidia" or device.capability < minimum:
        return False
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if listed:
        try:
            archs = parse_arch_list(listed)
        except ValueError as exc:
            log.warning("%s; treating the target as not qualifying", exc)
            return False
        return all(a >= minimum for a in archs)
    return True
