"""``int4-weight``: weight-only INT4 (RTN or AWQ) of the linear layers, stored in MatMulNBits layout.

Which linears: exact ``nn.Linear`` modules of the components switched on (the language model by
default; vision tower, projector and LM head are opt-in, as in AWQ / ModelOpt / ORT GenAI
releases), minus ``exclude`` patterns (``fnmatch`` on qualified module names). Subclasses of
``nn.Linear`` with their own forward (IDEFICS's decoupled LM head) are left alone and reported.
A tied LM head is skipped: quantizing it would not free the shared embedding.

Each is replaced by :class:`~mmsdk.plugins.quantizers.int4_linear.Int4Linear`; the torch export
holds its packed buffers and ``restore`` rebuilds empty ones on load. SiLU-gated MLPs whose gate
and up projections were both quantized get a body that runs them as one kernel pair on CUDA
(mmsdk/plugins/quantizers/int4_mlp.py).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

import mmsdk
from mmsdk.core.config import PassConfig
from mmsdk.core.errors import ConfigError, IncompatiblePassError
from mmsdk.core.passes import CheckContext, PassContext, PassSpec
from mmsdk.core.registry import Registrar
from mmsdk.plugins.quantizers.awq import search_clip, search_scale
from mmsdk.plugins.quantizers.calibration_stats import CalibrationStats, collect_statistics
from mmsdk.plugins.quantizers.int4_linear import Int4Linear
from mmsdk.plugins.quantizers.int4_mlp import fuse_gated_mlps, install_gated_mlp
from mmsdk.plugins.quantizers.packing import padded_k

__all__ = ["Int4WeightConfig", "apply_int4_weight", "int4_targets", "packed_linear_bytes", "restore_int4_weight"]

COMPONENTS = ("vision_tower", "projector", "language_model", "lm_head")


class Int4WeightConfig(PassConfig):
    """Weight-only INT4 of linear layers, group-wise along the input dimension."""

    method: Literal["rtn", "awq"] = Field(
        "rtn", description="rtn: round to nearest; awq: activation-aware scales (needs calibration)."
    )
    group_size: Literal[32, 64, 128] = Field(
        32, description="Weights per scale along K (ORT takes all three, its CUDA kernels favour 32; TensorRT-LLM 64/128)."
    )
    symmetric: bool = Field(True, description="Scale only (zero point 8); False adds a 4-bit zero point per group.")
    vision_tower: bool = Field(False, description="Quantize the vision encoder's linears too.")
    projector: bool = Field(False, description="Quantize the vision-to-language projector.")
    language_model: bool = Field(True, description="Quantize the decoder's linears.")
    lm_head: bool = Field(False, description="Quantize the output projection.")
    exclude: tuple[str, ...] = Field((), description="fnmatch patterns of module names to keep in full precision.")
    gated_mlp_kernel: bool = Field(
        True,
        description="On CUDA, compute a SiLU-gated MLP's INT4 gate and up projections for one token in one kernel "
        "pair (GEMV over both + SiLU*mul epilogue) instead of six kernels; the linears and exports are unchanged.",
    )
    indivisible: Literal["auto", "error", "pad", "skip"] = Field(
        "auto",
        description="A layer whose input size the group size does not divide (real model widths never are; toy "
        "ones often): 'error' refuses, 'pad' zero-pads K (torch and ONNX Runtime take it; a TensorRT-LLM export "
        "refuses and says to use 'skip'), 'skip' keeps the layer in full precision; 'auto' pads when group_size "
        "was left at its default and refuses when you chose it.",
    )
    awq_grid: int = Field(20, ge=1, le=100, description="Scale exponents tried by AWQ's search.")
    awq_clip: bool = Field(True, description="Also search a per-group clipping ratio (AWQ auto_clip).")
    awq_max_tokens: int = Field(512, ge=16, description="Calibration rows kept per linear input for the search.")

    def indivisible_policy(self) -> str:
        """What happens to a layer the group size does not divide: 'error', 'pad' or 'skip' ('auto' resolved)."""
        if self.indivisible != "auto":
            return self.indivisible
        return "error" if "group_size" in self.model_fields_set else "pad"


def _wants_calibration(config: Int4WeightConfig) -> bool:
    return config.method == "awq"


def _tied_to_embedding(model: nn.Module, module: nn.Module, context_adapter: Any) -> bool:
    try:
        embedding = context_adapter.embed_tokens(model)
    except AttributeError:
        return False
    weight = getattr(embedding, "weight", None)
    return weight is not None and weight.data_ptr() == module.weight.data_ptr()


def int4_targets(
    model: nn.Module, adapter: Any, config: Int4WeightConfig
) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """(linears to quantize by name, linears left alone with the reason) for ``config``."""
    owner = adapter.component_map(model)
    chosen: dict[str, nn.Linear] = {}
    skipped: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not getattr(config, owner.get(name, ""), False):
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.exclude):
            skipped[name] = "excluded by pattern"
        elif type(module) is not nn.Linear:
            skipped[name] = f"{type(module).__name__} has its own forward"
        elif owner[name] == "lm_head" and _tied_to_embedding(model, module, adapter):
            skipped[name] = "tied to the input embedding"
        elif module.in_features % config.group_size and config.indivisible_policy() == "skip":
            skipped[name] = f"in_features {module.in_features} not divisible by {config.group_size}"
        else:
            chosen[name] = module
    return chosen, skipped


def _foreign_quantization(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    qconfig = getattr(config, "quantization_config", None)
    if qconfig is not None:
        method = qconfig.get("quant_method") if isinstance(qconfig, dict) else getattr(qconfig, "quant_method", None)
        return f"its config carries quantization_config (quant_method={method!r})"
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        return "transformers marks it as quantized"
    for name, param in model.named_parameters():
        if not param.dtype.is_floating_point or type(param.data) not in (torch.Tensor, nn.Parameter):
            return f"parameter {name} is a {type(param.data).__name__} of dtype {param.dtype}"
    return None


def check_int4_weight(ctx: CheckContext) -> None:
    """Refuse models already quantized (by mmsdk or another tool) and layers the group size does not divide."""
    config: Int4WeightConfig = ctx.config  # type: ignore[assignment]
    model = ctx.model
    if any(isinstance(m, Int4Linear) for m in model.modules()):
        raise IncompatiblePassError(
            "this model already holds int4-weight layers (Int4Linear); quantizing twice would compound the error.",
            fix="apply int4-weight once, to the unquantized model.",
        )
    foreign = _foreign_quantization(model)
    if foreign:
        raise IncompatiblePassError(
            f"this model is already quantized by another tool: {foreign}.",
            fix="load the original floating-point checkpoint and let int4-weight quantize it.",
        )
    targets, _ = int4_targets(model, ctx.adapter, config)
    if not targets:
        raise ConfigError(
            "int4-weight found no linear layer to quantize with this config.",
            fix="switch on a component (language_model=True) or loosen `exclude`.",
        )
    bad = {n: m.in_features for n, m in targets.items() if m.in_features % config.group_size}
    if bad and config.indivisible_policy() == "error":
        sizes = sorted(set(bad.values()))
        fitting = [g for g in (32, 64, 128) if all(m.in_features % g == 0 for m in targets.values())]
        listed = ", ".join(f"{n} (in_features {k})" for n, k in list(bad.items())[:4])
        raise ConfigError(
            f"group_size={config.group_size} does not divide the input size of {len(bad)} layer(s) "
            f"(sizes {sizes}): {listed}.",
            fix=(f"use group_size={fitting[0]}, " if fitting else "")
            + "set indivisible='pad' (zero-pads K; torch and ONNX Runtime) or 'skip', or exclude those layers.",
        )


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    override = getattr(parent, attr).__dict__.get("forward")  # a KV pass memoising cross-attention K/V here
    setattr(parent, attr, module)
    if override is not None and hasattr(override, "rebind"):
        override.rebind(module)


def _awq_plan(stats: CalibrationStats, targets: Mapping[str, nn.Linear], config: Int4WeightConfig) -> dict[str, Any]:
    """Per linear: the AWQ channel scale and clip ratios; per group: the exponent and errors."""
    plan: dict[str, Any] = {"scale": {}, "clip": {}, "ratios": {}, "errors": {}}
    for leader, names in stats.groups().items():
        names = [n for n in names if n in targets]
        entry = stats.linears[leader]
        if not names or entry.rows.rows is None:
            continue
        rows = entry.rows.rows
        choice = search_scale(
            [targets[n].weight for n in names],
            rows,
            entry.abs_mean,
            block_size=config.group_size,
            symmetric=config.symmetric,
            grid=config.awq_grid,
        )
        plan["ratios"][leader] = choice.ratio
        plan["errors"][leader] = {"awq": choice.error, "rtn": choice.rtn_error}
        for name in names:
            plan["scale"][name] = choice.scale
            if config.awq_clip:
                weight = targets[name].weight.detach().float() * choice.scale.to(targets[name].weight.device)
                plan["clip"][name] = search_clip(
                    weight,
                    rows / choice.scale,
                    block_size=config.group_size,
                    symmetric=config.symmetric,
                    grid=config.awq_grid,
                )
    return plan


def apply_int4_weight(model: nn.Module, config: Int4WeightConfig, context: PassContext) -> dict[str, Any]:
    """Quantize the targeted linears in place; return what was quantized, skipped and (AWQ) chosen."""
    targets, skipped = int4_targets(model, context.adapter, config)
    plan: dict[str, Any] = {"scale": {}, "clip": {}, "ratios": {}, "errors": {}}
    calibration: dict[str, Any] = {}
    if config.method == "awq":
        calib = context.require_calibration("int4-weight")
        stats = collect_statistics(
            model,
            context.adapter,
            calib,
            context.processor,
            linears=targets,
            max_rows=config.awq_max_tokens,
            description="int4-weight: AWQ statistics",
        )
        plan = _awq_plan(stats, targets, config)
        prequant = {n: (1.0 / s).tolist() for n, s in plan["scale"].items()}
        calibration = {
            "calibration_set": calib.name,
            "samples": len(calib),
            "awq": {
                "group_size": config.group_size,
                "symmetric": config.symmetric,
                "prequant": prequant,
                "ratios": plan["ratios"],
            },
        }
    quantized: dict[str, dict[str, Any]] = {}
    for name, linear in targets.items():
        new = Int4Linear.from_linear(
            linear,
            block_size=config.group_size,
            symmetric=config.symmetric,
            channel_scale=plan["scale"].get(name),
            clip=plan["clip"].get(name),
        )
        _replace(model, name, new)
        quantized[name] = {
            "in_features": linear.in_features,
            "out_features": linear.out_features,
            "bias": linear.bias is not None,
            "prequant": new.prequant is not None,
            "padded_to": padded_k(linear.in_features, config.group_size),
        }
    records: dict[str, Any] = {"quantized": quantized, "skipped": skipped, "awq_errors": plan["errors"]}
    if config.gated_mlp_kernel:
        records["gated_mlp"] = fuse_gated_mlps(model, context.adapter)
    if calibration:
        records["calibration"] = calibration
    return records


def restore_int4_weight(
    model: nn.Module, config: Int4WeightConfig, records: Mapping[str, Any], context: PassContext
) -> None:
    """Put empty Int4Linear modules where the export had them, so the saved buffers load into them."""
    for name, info in records.get("quantized", {}).items():
        old = model.get_submodule(name)
        _replace(
            model,
            name,
            Int4Linear(
                info["in_features"],
                info["out_features"],
                block_size=config.group_size,
                symmetric=config.symmetric,
                bias=info["bias"],
                prequant=info["prequant"],
                dtype=old.weight.dtype,
                device=old.weight.device,
            ),
        )
    for name in records.get("gated_mlp", []):  # checked when the pass ran; the weights load after this
        install_gated_mlp(model.get_submodule(name), context.adapter)


def packed_linear_bytes(
    in_features: int,
    out_features: int,
    *,
    group_size: int,
    symmetric: bool,
    bias: bool,
    prequant: bool,
    element_bytes: int,
) -> int:
    """Theoretical bytes of one packed INT4 linear: nibbles, scales, zero points, bias and AWQ prequant."""
    k_blocks = padded_k(in_features, group_size) // group_size
    total = out_features * k_blocks * group_size // 2 + out_features * k_blocks * element_bytes
    total += 0 if symmetric else out_features * -(-k_blocks // 2)
    total += out_features * element_bytes if bias else 0
    return total + (in_features * element_bytes if prequant else 0)


@mmsdk.hookimpl
def mmsdk_register_quantizers(register: Registrar[PassSpec]) -> None:
    register(
        PassSpec(
            name="int4-weight",
            config_cls=Int4WeightConfig,
            apply=apply_int4_weight,
            summary="weight-only INT4 (RTN or AWQ), group 32/64/128, stored in ONNX Runtime's MatMulNBits layout",
            fast_generate=True,  # tests/test_fast_generate.py: same tokens as transformers' loop
            check=check_int4_weight,
            restore=restore_int4_weight,
            needs_calibration=_wants_calibration,
        )
    )
