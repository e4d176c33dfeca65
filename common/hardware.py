"""What the hardware does natively, asked of PyTorch once: which half types
(bf16, fp16) run at full speed on the CPU and on the GPU.

On a CPU without native bf16 (x86 before AVX512: Intel before Skylake-SP,
AMD before Zen 4), oneDNN emulates it, and a bf16-autocast training step is
about 16x slower than fp32 (ResNet-18 on a 2-core AVX2 EPYC, issue 25); with
it, bf16 is about 2x faster. So precision defaults, warnings, benchmarks and
every run's config.json ask here, and nothing parses /proc/cpuinfo.

The answers are PyTorch's own: the CPU capability ATen dispatches to
(`torch.backends.cpu.get_cpu_capability()`) and oneDNN's bf16/fp16 support
checks; on GPUs the compute capability. Both caps that PyTorch and oneDNN
honour lower the answer too, so the emulated path can be forced, and its
cost seen, on any x86 machine:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 make test
"""
from __future__ import annotations

import dataclasses
import os
import platform
from typing import Optional

import torch

# x86 capabilities (ATen's names) under which oneDNN has no native bf16/fp16 path.
_BELOW_AVX512 = ("DEFAULT", "NO AVX", "AVX", "AVX2")
# oneDNN's instruction-set cap, and the old name of the variable: an ISA of the AVX2 family or older
# (SSE41, AVX, AVX2, AVX2_VNNI, AVX2_VNNI_2) leaves bf16 and fp16 emulated.
_ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# What native support needs, by device type and half type, in the words of the warning.
_NEEDS = {("cpu", "bf16"): "AVX512, best with AVX512-BF16 or AMX", ("cpu", "fp16"): "AVX512-FP16 or AMX-FP16",
          ("cuda", "bf16"): "compute capability 8.0", ("cuda", "fp16"): "compute capability 7.0, or 6.0"}
# The slowdown measured where it was (issue 25: ResNet-18, batch 32, channels-last, O1 against O0).
_MEASURED_COST = {("cpu", "bf16"): " (16x for ResNet-18 on a 2-core AVX2 EPYC)"}


@dataclasses.dataclass(frozen=True)
class HalfSupport:
    """Which half types one device runs natively."""

    device_type: str  # cpu | cuda
    capability: str  # the CPU's ATen capability (AVX2, AVX512, ...) or the GPU's compute capability (sm_90)
    bf16_native: bool
    fp16_native: bool
    capped_by: Optional[str] = None  # the environment setting that lowered the answer, if one did

    def native(self, dtype_name: str) -> bool:
        return self.bf16_native if dtype_name == "bf16" else self.fp16_native

    @property
    def where(self) -> str:
        """'CPU' or 'GPU', for messages."""
        return "CPU" if self.device_type == "cpu" else "GPU"

    def emulation_warning(self, dtype_name: str, opt_level: str) -> Optional[str]:
        """One line for a run asked to train in `dtype_name` where it is
        emulated: the cause, the cost and the alternative; None where it is native."""
        if self.native(dtype_name):
            return None
        capped = f", capped by {self.capped_by}" if self.capped_by else ""
        return (f"warning: {dtype_name} is emulated on this {self.where} ({self.capability}{capped}; native {dtype_name} "
                f"needs {_NEEDS[self.device_type, dtype_name]}): expect --opt-level {opt_level} to train much slower "
                f"than fp32{_MEASURED_COST.get((self.device_type, dtype_name), '')}; --opt-level O0 trains in fp32 "
                f"at full speed")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cpu_half_support() -> HalfSupport:
    """The CPU's half types, as PyTorch's dispatcher and oneDNN see them."""
    capability = torch.backends.cpu.get_cpu_capability()  # honours ATEN_CPU_CAPABILITY
    bf16 = _onednn_supports("_is_mkldnn_bf16_supported")
    fp16 = _onednn_supports("_is_mkldnn_fp16_supported")
    capped_by = None
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        if capability.upper() in _BELOW_AVX512:
            bf16 = fp16 = False
            capped_by = _setting("ATEN_CPU_CAPABILITY")
        isa_cap = next(((name, os.environ[name]) for name in _ONEDNN_ISA_VARIABLES if os.environ.get(name)), None)
        if isa_cap and isa_cap[1].upper().startswith(("SSE", "AVX")) and \
                not isa_cap[1].upper().startswith(("AVX512", "AVX10")):
            bf16 = fp16 = False
            capped_by = f"{isa_cap[0]}={isa_cap[1]}"
    return HalfSupport("cpu", capability, bf16_native=bf16, fp16_native=fp16, capped_by=capped_by)


def gpu_half_support(device: torch.device) -> HalfSupport:
    """A CUDA GPU's half types: bf16 from compute capability 8.0 (Ampere); fp16
    at full rate from 7.0 (tensor cores) and on 6.0/6.2 (P100, Jetson TX2),
    not on 6.1 (consumer Pascal runs fp16 at 1/64 of fp32)."""
    major, minor = torch.cuda.get_device_capability(device)
    return HalfSupport("cuda", f"sm_{major}{minor}", bf16_native=major >= 8,
                       fp16_native=major >= 7 or (major, minor) in ((6, 0), (6, 2)))


def half_support(device: torch.device) -> HalfSupport:
    return gpu_half_support(device) if device.type == "cuda" else cpu_half_support()


def describe(device: Optional[torch.device] = None) -> dict:
    """The CPU's half-precision support, and the GPU's where `device` is one:
    flat fields for config.json's environment and benchmark rows."""
    cpu = cpu_half_support()
    fields = {"cpu_capability": cpu.capability, "cpu_bf16_native": cpu.bf16_native,
              "cpu_fp16_native": cpu.fp16_native, "cpu_capped_by": cpu.capped_by}
    if device is not None and device.type == "cuda":
        gpu = gpu_half_support(device)
        fields.update(gpu_capability=gpu.capability, gpu_bf16_native=gpu.bf16_native, gpu_fp16_native=gpu.fp16_native)
    return fields


def _onednn_supports(check: str) -> bool:
    """oneDNN's own answer; False where this PyTorch has no such check (or no oneDNN)."""
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return False


def _setting(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return f"{name}={value}" if value else None
