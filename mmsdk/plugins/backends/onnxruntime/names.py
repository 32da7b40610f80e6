"""Tensor names at the boundaries of the exported graphs (ONNX Runtime GenAI's where it has them)."""

from __future__ import annotations

__all__ = [
    "INPUT_IDS",
    "INPUTS_EMBEDS",
    "IMAGE_FEATURES",
    "ATTENTION_MASK",
    "POSITION_IDS",
    "CROSS_ATTENTION_MASK",
    "IMAGE_TOKEN_MASK",
    "LOGITS",
    "PAST_KEY",
    "PAST_VALUE",
    "PRESENT_KEY",
    "PRESENT_VALUE",
    "CROSS_KEY",
    "CROSS_VALUE",
    "BATCH",
    "SEQUENCE",
    "TOTAL",
    "PAST",
    "past_key",
    "past_value",
    "present_key",
    "present_value",
    "cross_key",
    "cross_value",
    "past_image_key_sums",
    "present_image_key_sums",
]

INPUT_IDS = "input_ids"
INPUTS_EMBEDS = "inputs_embeds"
IMAGE_FEATURES = "image_features"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
CROSS_ATTENTION_MASK = "cross_attention_mask"
IMAGE_TOKEN_MASK = "image_token_mask"  # [B, T] 1 where a (cached or current) token is an image token
LOGITS = "logits"
PAST_KEY = "past_key_values.%d.key"
PAST_VALUE = "past_key_values.%d.value"
PRESENT_KEY = "present.%d.key"
PRESENT_VALUE = "present.%d.value"
CROSS_KEY = "cross_key_values.%d.key"
CROSS_VALUE = "cross_key_values.%d.value"
# sparse-xattn with a quantized KV cache: per-block sums of the (dequantized) image keys, carried like the cache
PAST_IMAGE_KEY_SUMS = "past_key_values.%d.image_key_sums"
PRESENT_IMAGE_KEY_SUMS = "present.%d.image_key_sums"

# Symbolic axis names (the ones the GenAI model builder writes).
BATCH = "batch_size"
SEQUENCE = "sequence_length"
TOTAL = "total_sequence_length"
PAST = "past_sequence_length"


def past_key(layer: int) -> str:
    return PAST_KEY % layer


def past_value(layer: int) -> str:
    return PAST_VALUE % layer


def present_key(layer: int) -> str:
    return PRESENT_KEY % layer


def present_value(layer: int) -> str:
    return PRESENT_VALUE % layer


def cross_key(layer: int) -> str:
    return CROSS_KEY % layer


def cross_value(layer: int) -> str:
    return CROSS_VALUE % layer


def past_image_key_sums(layer: int) -> str:
    return PAST_IMAGE_KEY_SUMS % layer


def present_image_key_sums(layer: int) -> str:
    return PRESENT_IMAGE_KEY_SUMS % layer
