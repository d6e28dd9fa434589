"""What the machine computes with: the CPU's model and flags, and whether a device does bfloat16 arithmetic natively.

Costs are read from the machine, never assumed. bf16 is fast only where the hardware has bf16 units: every current
GPU, and CPUs with Intel AMX or AVX512-BF16 (``amx_bf16``, ``avx512_bf16``; Arm's ``bf16``). Elsewhere PyTorch emulates
it: a matmul of the default model's shapes took 129x fp32's time on an AVX2-only AMD EPYC, and 2.7x on an AVX-512
Intel Xeon without bf16 units. A flag is not a speed: on an Intel Xeon listing ``avx512_bf16`` without AMX it took
1.6-1.7x fp32's time, where AMD EPYCs with the same flag run it at 3.0x (family not recorded) and 4.4-5x (family 26,
Zen 5) fp32's rate. :func:`bf16_time_ratio` measures the ratio on the device at hand, and benchmarks print
:func:`machine_summary` beside every ratio they report.
"""
from __future__ import annotations

import functools
import platform
import time
from pathlib import Path

import torch

# CPU flags (Linux /proc/cpuinfo) that mean native bf16 arithmetic: x86's AMX and AVX512-BF16, Arm's BF16 extension.
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# CPU flags of a bf16 unit fast enough for the guarded precision to beat fp32 (cel_utils.evaluation.precision): Intel's
# AMX (a bf16 matmul about 4x fp32's rate; guarded stage 1 of the default model 1.22-1.60x fp32, book/speed.md), not
# AVX512-BF16 alone (an AMD EPYC of unrecorded family: a bf16 matmul 3.0x, the fast pass only 1.6x, guarded 0.9x fp32;
# an Intel Xeon without AMX: a bf16 matmul 1.6-1.7x slower than fp32). An EPYC of family 26 (Zen 5) runs the layers 3.0x
# faster in bf16, yet guarded replaying the main job's own BoolQ search there took 0.91x fp32's time (book/speed.md).
GUARDED_FLAGS = ("amx_bf16",)
# The flags a reader of a benchmark needs to place its numbers: vector width and the bf16 / int8 units.
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "neon", "asimd", "sve", "bf16")


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """The CPU's model name, flags and ``kind``; ``flags`` is None where the OS does not list them (not Linux).

    ``kind`` is x86's family and model numbers ("family 26 model 2"), None where the OS gives none: machines of one
    name differ (an "AMD EPYC" of family 25 is Zen 3 or Zen 4, told apart by the model number; of family 26, Zen 5),
    and a benchmark's reader needs to know which.
    """
    model, flags, kind = platform.processor() or platform.machine(), None, None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        fields: dict[str, str] = {}
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if not line.strip():
                if fields:
                    break  # the first processor describes them all
                continue
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        model = fields.get("model name") or fields.get("Hardware") or fields.get("CPU part") or model
        flags = set((fields.get("flags") or fields.get("Features") or "").split())
        if "cpu family" in fields and "model" in fields:
            kind = f"family {fields['cpu family']} model {fields['model']}"
    return {"model": model, "flags": flags, "kind": kind, "torch_capability": torch.backends.cpu.get_cpu_capability()}


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` computes bf16 in hardware: a CUDA GPU that supports it, or a CPU listing a bf16 flag (where
    the OS lists no flags, a bf16 matmul measured faster than fp32's)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except (AssertionError, RuntimeError):  # no usable CUDA in this process (a CPU build, a driverless login node)
            return False
    flags = cpu_info()["flags"]
    if flags is None:
        return not bf16_is_slow(device)
    return any(flag in flags for flag in BF16_FLAGS)


def guarded_pays(device: torch.device | str = "cpu") -> bool:
    """Whether the guarded precision was measured faster than fp32 on a device of this kind: a CUDA GPU with bf16
    units, or a CPU with one of :data:`GUARDED_FLAGS`."""
    device = torch.device(device)
    if device.type == "cuda":
        return native_bf16(device)
    flags = cpu_info()["flags"]
    return flags is not None and any(flag in flags for flag in GUARDED_FLAGS)


@functools.lru_cache(maxsize=8)
def bf16_time_ratio(device: str = "cpu", rows: int = 128, inner: int = 576, cols: int = 1536) -> float:
    """Measured here: a bf16 matmul's time over the same fp32 matmul's (below 1: bf16 is faster).

    The default shapes are one linear layer of the default model on a batch of 128 tokens; the best of five runs
    each, after a warm-up (about 0.1 s with bf16 units, under 1 s without).
    """
    dev = torch.device(device)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(rows, inner, device=dev).to(dtype)
        b = torch.randn(inner, cols, device=dev).to(dtype)
        best = float("inf")
        for _ in range(6):  # the first is a warm-up, counted only if it is the fastest
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            a @ b
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - start)
        times[dtype] = best
    return times[torch.bfloat16] / times[torch.float32]


def bf16_is_slow(device: torch.device | str = "cpu") -> bool:
    """Whether a bf16 matmul was measured no faster than fp32's on ``device`` (:func:`bf16_time_ratio` at least 1):
    a CPU without bf16 units, or one whose units are slower than its fp32 path (an Intel Xeon with AVX512-BF16 and no
    AMX)."""
    return bf16_time_ratio(str(torch.device(device))) >= 1.0


def device_name(device: torch.device | str) -> str:
    """The device for a message: a CPU's model name, else the device as torch names it (``cuda:0``)."""
    device = torch.device(device)
    return cpu_info()["model"] if device.type == "cpu" else str(device)


def machine_summary() -> str:
    """One line for a benchmark's output: the CPU, its relevant flags, torch's kernel level, its threads, any GPU."""
    info = cpu_info()
    flags = "flags unknown" if info["flags"] is None else (
        " ".join(f for f in SHOWN_FLAGS if f in info["flags"]) or "none of " + " ".join(SHOWN_FLAGS))
    bf16 = "bf16 units" if native_bf16("cpu") else "no bf16 units"
    kind = f"{info['kind']}; " if info.get("kind") else ""
    line = (f"CPU: {info['model']} ({kind}{flags}; {bf16}); torch {torch.__version__} "
            f"kernels {info['torch_capability']}, {torch.get_num_threads()} threads")
    if torch.cuda.is_available():
        line += f"; GPU: {torch.cuda.get_device_name(0)}"
    return line
