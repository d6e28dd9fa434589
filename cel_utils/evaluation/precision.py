"""What the evaluations compute in: the precision settings, what ``auto`` means, the bfloat16 copy they compute with.

``fp32`` computes with the model as loaded (float32 unless its dtype says otherwise); ``bf16`` with a bfloat16 copy
(:func:`bf16_model`; approximate: rounding flips ~1% of decisions); ``guarded`` in bf16 with fp32's decisions
(:mod:`cel_utils.evaluation.guarded`, which reaches the engine through one seam: its ``above`` model). What ``auto``
means is decided here (:func:`resolve_precision`, from the device, the task's kind and the engine): a run reads it
through :func:`cel_utils.pipeline.protocol.run_precision` for its evaluators, its model's dtype and its artifact.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from typing import TYPE_CHECKING

import torch

from cel_utils.models.loading import LoadedModel

if TYPE_CHECKING:
    from cel_utils.evaluation.kinds import TaskKind


def resolve_precision(precision: str, device: torch.device | str, kind: TaskKind | None = None,
                      engine: str = "fast", ablation: str = "zero", dtype: str = "auto") -> str:
    """``precision`` as it resolves on ``device``, for a task of ``kind`` evaluated by ``engine``.

    ``auto`` is ``guarded`` where guarded was measured faster than fp32 (:func:`cel_utils.hardware.guarded_pays`: a
    CUDA GPU with bf16 units, a CPU with Intel's AMX; not AVX512-BF16 alone: 0.9x fp32 on an AMD EPYC, 0.46-0.56x on
    an Intel Xeon without AMX, whose bf16 matmuls are slower than its fp32 ones), with the fast engine (the guard's
    rechecks need it), zero-ablation and float32 weights (its rechecks zero heads in fp32), for a kind where guarded
    paid (``TaskKind.auto_guarded``: multiple choice, stage 1 of the default model on 2 threads of a
    Xeon with AMX: BoolQ 1.31-1.60x, HellaSwag 1.22-1.36x; book/speed.md); else ``fp32``. Guarded took
    arithmetic_1dc (short items after a 3-shot prefix, where bf16 itself gained 1.33x) 2.0x fp32's time, and MBPP's
    decoding guard rechecked every row (:mod:`cel_utils.evaluation.guarded_generation`). ``kind`` None: what the
    device allows, whatever the task. Any other setting resolves to itself. Whatever ``auto`` resolves to, the numbers
    a run prints are the same (:func:`cel_utils.pipeline.protocol.holdout_config`); only the time differs."""
    from cel_utils.config import PRECISIONS

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if engine != "fast" or (kind is not None and not kind.auto_guarded):
        return "fp32"
    if ablation != "zero" or dtype not in ("auto", "float32", "fp32"):  # the rechecks zero heads, from fp32 weights
        return "fp32"
    from cel_utils.hardware import guarded_pays

    return "guarded" if guarded_pays(device) else "fp32"


def warn_if_bf16_is_slow(precision: str, device: torch.device | str) -> None:
    """Warn when a run computes in bfloat16 (precision ``bf16`` or ``guarded``, asked for or resolved) on a device
    where a bf16 matmul was measured no faster than fp32's (:func:`cel_utils.hardware.bf16_time_ratio`): a CPU without
    bf16 units, or one whose units are slower than its fp32 path, as on an Intel Xeon listing ``avx512_bf16`` without
    AMX (1.6-1.7x fp32's time; book/speed.md). The run's numbers are what the precision computes; only its time is
    worse than fp32's, which is exact."""
    if precision not in ("bf16", "guarded"):
        return
    from cel_utils.hardware import bf16_is_slow, bf16_time_ratio, device_name

    if bf16_is_slow(device):
        ratio = bf16_time_ratio(str(torch.device(device)))  # measured once per process: this reads it back
        warnings.warn(f"precision {precision} computes in bfloat16, but a bf16 matmul took {ratio:.1f}x float32's time "
                      f"on {device_name(device)}: this run is slower than it would be in fp32, which is exact; use "
                      "precision fp32 on this machine", stacklevel=2)


_BF16_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def bf16_model(lm: LoadedModel) -> LoadedModel:
    """A bfloat16 copy of ``lm``'s model (made once per model, kept while the model lives); ``lm`` if it is bf16."""
    if lm.dtype == torch.bfloat16:
        return lm
    copied = _BF16_COPIES.get(lm.model)
    if copied is None:
        copied = copy.deepcopy(lm.model).to(torch.bfloat16)
        _BF16_COPIES[lm.model] = copied
    return dataclasses.replace(lm, model=copied)
