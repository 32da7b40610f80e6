"""Turning user images (PIL, arrays, tensors) into normalized CxSxS float tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mmsdk.core.errors import UnsupportedInputError

__all__ = ["prepare_image", "to_chw_float"]


def to_chw_float(image: Any) -> torch.Tensor:
    """A 3xHxW float tensor in [0, 1] from a PIL image, an HxW/HxWxC array or a CxHxW tensor."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image without importing PIL
        image = np.asarray(image.convert("RGB"))
    if isinstance(image, torch.Tensor):
        tensor = image.detach().to("cpu")
        channels_first = tensor.ndim == 3 and tensor.shape[0] in (1, 3, 4) and tensor.shape[-1] not in (1, 3, 4)
        array = tensor.numpy()
        if channels_first:
            array = np.moveaxis(array, 0, -1)
    else:
        array = np.asarray(image)
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4) or min(array.shape[:2]) < 1:
        raise UnsupportedInputError(
            f"an image of shape {tuple(array.shape)} cannot be read; expected HxW, HxWx(1|3|4) or (1|3|4)xHxW.",
            fix="pass one RGB or grayscale image per prompt.",
        )
    if array.dtype == np.uint8:
        values = array.astype(np.float32) / 255.0
    elif np.issubdtype(array.dtype, np.integer):
        values = array.astype(np.float32) / max(float(array.max()), 1.0)
    else:
        values = array.astype(np.float32)
    if not np.isfinite(values).all():
        raise UnsupportedInputError("the image holds NaN or inf values.", fix="clean the image before passing it.")
    values = values[..., :3] if values.shape[-1] >= 3 else np.repeat(values, 3, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(values, -1, 0)))


def prepare_image(image: Any, size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Resize to ``size`` x ``size`` (bilinear) and normalize: a 3 x size x size float32 tensor."""
    chw = to_chw_float(image)
    if chw.shape[1:] != (size, size):
        chw = F.interpolate(chw[None], size=(size, size), mode="bilinear", align_corners=False)[0]
    mean_t = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    std_t = torch.tensor(std, dtype=torch.float32)[:, None, None]
    return (chw - mean_t) / std_t
