"""The per-family input conventions of the embedded processors (one class per model family)."""

from __future__ import annotations

import torch

from mmsdk.models.processing import VLProcessor

__all__ = ["CLASSES", "IdeficsProcessor", "LlavaNextProcessor", "LlavaProcessor", "MllamaProcessor", "QwenVLProcessor"]


class LlavaProcessor(VLProcessor):
    """LLaVA-1.5: one <image> token per vision patch (CLS dropped), pixels [B, 3, S, S]."""

    family = "llava"
    placeholder = "<image>"

    def tokens_per_image(self) -> int:
        side = self.image_size // self.patch_size
        return side * side

    def image_token_ids(self) -> list[int]:
        return [self.tokenizer.token_id("<image>")] * self.tokens_per_image()

    def image_tensors(self, pixels: list[torch.Tensor], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.stack(pixels)}


class LlavaNextProcessor(LlavaProcessor):
    """LLaVA-NeXT with one any-res tile equal to the base view: pixels [B, 2, 3, S, S].

    The grid of a 1x1 tile adds side*(side+1) tokens (one image-newline per row) to the base view's
    side*side, which is what LlavaNextForConditionalGeneration packs for image_sizes == (S, S).
    """

    family = "llava-next"

    def tokens_per_image(self) -> int:
        side = self.image_size // self.patch_size
        return side * side + side * (side + 1)

    def image_tensors(self, pixels: list[torch.Tensor], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        tiles = torch.stack([torch.stack([p, p]) for p in pixels])
        sizes = torch.tensor([[self.image_size, self.image_size]] * len(pixels), dtype=torch.long)
        return {"pixel_values": tiles, "image_sizes": sizes}


class QwenVLProcessor(VLProcessor):
    """Qwen2-VL / Qwen2.5-VL: flattened temporal patches, grid_thw, merged-token pads, M-RoPE types."""

    family = "qwen-vl"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    @property
    def merge_size(self) -> int:
        return int(self.options.get("merge_size", 2))

    @property
    def temporal_patch_size(self) -> int:
        return int(self.options.get("temporal_patch_size", 2))

    def tokens_per_image(self) -> int:
        side = self.image_size // self.patch_size
        return side * side // (self.merge_size**2)

    def image_token_ids(self) -> list[int]:
        tok = self.tokenizer
        pads = [tok.token_id("<|image_pad|>")] * self.tokens_per_image()
        return [tok.token_id("<|vision_start|>"), *pads, tok.token_id("<|vision_end|>")]

    def patchify(self, chw: torch.Tensor) -> torch.Tensor:
        """[C, S, S] -> [grid_h*grid_w, C*T*p*p] in the order Qwen2-VL's vision tower reads."""
        c, p, m, t = chw.shape[0], self.patch_size, self.merge_size, self.temporal_patch_size
        gh = gw = self.image_size // p
        x = chw.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, *x.shape[5:])
        return x.reshape(gh * gw, c * t * p * p)

    def image_tensors(self, pixels: list[torch.Tensor], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        side = self.image_size // self.patch_size
        pad_id = self.tokenizer.token_id("<|image_pad|>")
        return {
            "pixel_values": torch.cat([self.patchify(p) for p in pixels]),
            "image_grid_thw": torch.tensor([[1, side, side]] * len(pixels), dtype=torch.long),
            "mm_token_type_ids": (input_ids == pad_id).to(torch.int32),
        }

    def format_prompt(self, question: str) -> str:
        return f"{self.placeholder}{question}"


class IdeficsProcessor(VLProcessor):
    """IDEFICS: one <image> between fake tokens; tokens from it onwards attend to the image."""

    family = "idefics"
    placeholder = "<fake_token_around_image><image><fake_token_around_image>"

    def image_token_ids(self) -> list[int]:
        tok = self.tokenizer
        fake = tok.token_id("<fake_token_around_image>")
        return [fake, tok.token_id("<image>"), fake]

    def image_tensors(self, pixels: list[torch.Tensor], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": torch.stack(pixels)[:, None],
            "image_attention_mask": _after_marker(input_ids, self.tokenizer.token_id("<image>"))[..., None],
        }

    def format_prompt(self, question: str) -> str:
        return f"{self.placeholder}{question}"


class MllamaProcessor(VLProcessor):
    """Mllama: one <|image|> token; one tile per image; cross-attention mask from the token onwards."""

    family = "mllama"
    placeholder = "<|image|>"

    @property
    def max_num_tiles(self) -> int:
        return int(self.options.get("max_num_tiles", 1))

    def image_token_ids(self) -> list[int]:
        return [self.tokenizer.token_id("<|image|>")]

    def image_tensors(self, pixels: list[torch.Tensor], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        batch, tiles = len(pixels), self.max_num_tiles
        stacked = torch.zeros(batch, 1, tiles, *pixels[0].shape)
        stacked[:, 0, 0] = torch.stack(pixels)
        ratio_mask = torch.zeros(batch, 1, tiles, dtype=torch.long)
        ratio_mask[:, :, 0] = 1
        cross = torch.zeros(batch, input_ids.shape[1], 1, tiles, dtype=torch.long)
        cross[:, :, 0, 0] = _after_marker(input_ids, self.tokenizer.token_id("<|image|>"))
        return {
            "pixel_values": stacked,
            "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long),  # id 1 = aspect ratio (1, 1)
            "aspect_ratio_mask": ratio_mask,
            "cross_attention_mask": cross,
        }


def _after_marker(input_ids: torch.Tensor, marker: int) -> torch.Tensor:
    """1 at and after the first ``marker`` of each row, else 0 (padding stays 0)."""
    return (torch.cumsum((input_ids == marker).long(), dim=1) > 0).long()


CLASSES: dict[str, type[VLProcessor]] = {
    cls.family: cls for cls in (LlavaProcessor, LlavaNextProcessor, QwenVLProcessor, IdeficsProcessor, MllamaProcessor)
}
