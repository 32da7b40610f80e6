"""genai_config.json, processor_config.json and tokenizer files for ONNX Runtime GenAI (Qwen2.5-VL).

GenAI runs the same vision / embedding / decoder graphs as mmsdk's runtime; it computes the
M-RoPE positions itself from ``image_token_id``, ``vision_start_token_id`` and
``spatial_merge_size``. Its image processor resizes to the one resolution the vision graph was
traced for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from mmsdk.plugins.backends.onnxruntime import names as N

if TYPE_CHECKING:
    from mmsdk.core.backend import ExportContext

__all__ = ["write_genai_files", "genai_config", "processor_config", "GENAI_CONFIG", "REQUIRED_FIELDS"]

GENAI_CONFIG = "genai_config.json"
PROCESSOR_CONFIG = "processor_config.json"
# Fields GenAI 0.18 needs for a qwen2_5_vl folder (src/config.h; the model type's M-RoPE needs the ids).
REQUIRED_FIELDS = {
    "model": ("type", "vocab_size", "context_length", "eos_token_id", "pad_token_id", "bos_token_id",
              "image_token_id", "vision_start_token_id", "decoder", "embedding", "vision"),
    "decoder": ("filename", "head_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                "num_key_value_heads", "inputs", "outputs"),
    "embedding": ("filename", "inputs", "outputs"),
    "vision": ("filename", "spatial_merge_size", "inputs", "outputs"),
    "search": ("do_sample", "max_length", "num_beams", "past_present_share_buffer"),
}


def genai_config(context: ExportContext, details: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The genai_config.json content."""
    config = context.model.config
    dec = details["decoder"]
    files = details["files"]
    gen = details["generation"]
    eos = gen["eos_token_ids"] or [config.get_text_config().eos_token_id]
    pad = gen["pad_token_id"] if gen["pad_token_id"] is not None else eos[0]
    text = context.adapter.text_config(context.model)
    session = {"log_id": "onnxruntime-genai", "provider_options": []}
    return {
        "model": {
            "type": model_type,
            "vocab_size": int(details["vocab_size"]),
            "context_length": int(dec["max_sequence_length"]),
            "bos_token_id": int(getattr(text, "bos_token_id", None) or getattr(config, "bos_token_id", None) or 0),
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": int(pad),
            "image_token_id": int(config.image_token_id),
            "video_token_id": int(getattr(config, "video_token_id", None) or config.image_token_id),
            "vision_start_token_id": int(config.vision_start_token_id),
            "decoder": {
                "session_options": session, "filename": files["decoder"],
                "head_size": dec["head_dim"], "hidden_size": dec["hidden_size"],
                "num_attention_heads": dec["num_heads"], "num_hidden_layers": len(dec["self_attention_layers"]),
                "num_key_value_heads": dec["num_kv_heads"],
                "inputs": {"inputs_embeds": N.INPUTS_EMBEDS, "attention_mask": N.ATTENTION_MASK,
                           "position_ids": N.POSITION_IDS, "past_key_names": N.PAST_KEY, "past_value_names": N.PAST_VALUE},
                "outputs": {"logits": N.LOGITS, "present_key_names": N.PRESENT_KEY,
                            "present_value_names": N.PRESENT_VALUE},
            },
            "embedding": {"session_options": session, "filename": files["embedding"],
                          "inputs": {"input_ids": N.INPUT_IDS, "image_features": N.IMAGE_FEATURES},
                          "outputs": {"inputs_embeds": N.INPUTS_EMBEDS}},
            "vision": {"session_options": session, "filename": files["vision"], "config_filename": PROCESSOR_CONFIG,
                       "spatial_merge_size": int(dec["spatial_merge_size"]),
                       "inputs": {"pixel_values": "pixel_values", "image_grid_thw": "image_grid_thw"},
                       "outputs": {"image_features": N.IMAGE_FEATURES}},
        },
        "search": {"do_sample": False, "early_stopping": True, "max_length": int(dec["max_sequence_length"]),
                   "min_length": 0, "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
                   "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def processor_config(processor: Any, grid: list[int], patch: int, merge: int, temporal: int) -> dict[str, Any]:
    """GenAI's (ort-extensions) image pipeline, resizing to the traced resolution ``grid`` * ``patch``."""
    mean = list(getattr(processor, "mean", None) or processor.image_processor.image_mean)
    std = list(getattr(processor, "std", None) or processor.image_processor.image_std)
    height, width = grid[1] * patch, grid[2] * patch

    def op(name: str, kind: str, **attrs: Any) -> dict[str, Any]:
        return {"operation": {"name": name, "type": kind, **({"attrs": attrs} if attrs else {})}}

    return {"processor": {"name": "qwen2_5_image_processor", "transforms": [
        op("decode_image", "DecodeImage", color_space="RGB"),
        op("convert_to_rgb", "ConvertRGB"),
        op("resize", "Resize", width=width, height=height, smart_resize=1, min_pixels=height * width,
           max_pixels=height * width, patch_size=patch, merge_size=merge),
        op("rescale", "Rescale", rescale_factor=1 / 255),
        op("normalize", "Normalize", mean=mean, std=std, qwen2_5_vl=1),
        op("patch_image", "PatchImage", patch_size=patch, temporal_patch_size=temporal, merge_size=merge),
    ]}}


def write_genai_files(context: ExportContext, details: Mapping[str, Any], folder: Path, model_type: str) -> dict:
    """Write the GenAI files next to the graphs; return the manifest record."""
    config = genai_config(context, details, model_type)
    _check_fields(config)
    (folder / GENAI_CONFIG).write_text(json.dumps(config, indent=2))
    vision_cfg = context.model.config.vision_config
    grid = details["vision"]["fixed_inputs"]["image_grid_thw"][0]
    proc = processor_config(context.processor, grid, int(vision_cfg.patch_size), int(vision_cfg.spatial_merge_size),
                            int(vision_cfg.temporal_patch_size))
    (folder / PROCESSOR_CONFIG).write_text(json.dumps(proc, indent=2))
    tokenizer_files = _write_tokenizer(context.processor, folder)
    return {"written": True, "model_type": model_type,
            "files": [GENAI_CONFIG, PROCESSOR_CONFIG, *tokenizer_files]}


def _check_fields(config: Mapping[str, Any]) -> None:
    sections = {"model": config["model"], "search": config["search"], **{
        k: config["model"][k] for k in ("decoder", "embedding", "vision")}}
    for section, fields in REQUIRED_FIELDS.items():
        missing = [f for f in fields if f not in sections[section]]
        if missing:  # a bug in this module, not a user error
            raise AssertionError(f"genai_config.json section {section!r} lacks {missing}")


def _write_tokenizer(processor: Any, folder: Path) -> list[str]:
    """HF tokenizer files: the processor's own, or a WordLevel tokenizer equal to mmsdk's word tokenizer."""
    hf = getattr(processor, "tokenizer", None)
    if hasattr(hf, "save_pretrained"):
        return [str(p.relative_to(folder)) for p in map(Path, hf.save_pretrained(str(folder)))]
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from tokenizers import AddedToken

    words = processor.tokenizer
    vocab = {word: index for index, word in enumerate(words.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in words.specials])
    bos = words.vocab[words.bos_token_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, words.bos_token_id)])
    tok.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": bos, "eos_token": words.vocab[words.eos_token_id],
                "pad_token": words.vocab[words.pad_token_id], "unk_token": "<unk>",
                "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return ["tokenizer.json", "tokenizer_config.json"]
