"""vit-prune: importance from calibration data, weights physically shrink, counts recorded, reload, refusals."""

from __future__ import annotations

import pytest
import torch

import mmsdk
from mmsdk import Optimizer
from mmsdk.core.errors import CalibrationError, IncompatiblePassError
from mmsdk.plugins.attention.qkv_fuse import QKVFuseConfig
from mmsdk.plugins.encoders.vit_prune import ViTPruneConfig
from mmsdk.testing import sample_image, tiny_inputs

CALIBRATION = [(sample_image(20 + i), q) for i, q in enumerate(("what digit is this ?", "is it even ?", "is it odd ?"))]


@pytest.mark.parametrize("name", ["tiny:llava", "tiny:qwen2.5-vl", "tiny:mllama"])
def test_heads_and_channels_shrink_and_the_export_reloads(name, session, tiny, tmp_path):
    loaded = tiny(name)
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(CALIBRATION)
    opt.apply(ViTPruneConfig(heads=1, mlp_ratio=0.5))
    blocks_before = [(b.num_heads, getattr(b.mlp, b.mlp_projections.down).in_features)
                     for b in opt.adapter.vision_blocks(loaded.model)]
    model = opt.model
    records = opt.results[0].records
    for block, (heads, channels), kept in zip(opt.adapter.vision_blocks(model), blocks_before, records["layers"],
                                              strict=True):
        assert block.num_heads == heads - 1 == len(kept["heads"])
        assert getattr(block.mlp, block.mlp_projections.down).in_features == channels - channels // 2
        o_proj = getattr(block.attention, block.projections.o)
        assert o_proj.in_features == (heads - 1) * block.head_dim
    assert records["vision_params"]["after"] < records["vision_params"]["before"]
    assert records["model_flops_one_prompt"]["after"] < records["model_flops_one_prompt"]["before"]
    inputs = tiny_inputs(loaded.processor, ("what digit is this ?", "is it even ?"))
    with torch.no_grad():
        pruned = model(**inputs).logits
    opt.export("torch", tmp_path / "out")
    reloaded = mmsdk.load(tmp_path / "out", session=session)  # restore rebuilds the shapes from the records
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, pruned)


def test_the_least_important_head_goes(session, tiny):
    loaded = tiny("tiny:llava")
    block = Optimizer(loaded.model, session=session).adapter.vision_blocks(loaded.model)[0]
    with torch.no_grad():  # silence head 1 of layer 0: it contributes nothing, so it must be the one removed
        block.attention.out_proj.weight[:, block.head_dim:2 * block.head_dim] = 0
    opt = Optimizer(loaded.model, loaded.processor, session=session).calibrate(CALIBRATION)
    opt.apply(ViTPruneConfig(heads=1, mlp_ratio=0.0)).model  # noqa: B018
    assert opt.results[0].records["layers"][0]["heads"] == [0]


def test_refusals_leave_the_model_untouched(session, tiny):
    loaded = tiny("tiny:llava")
    q_proj = Optimizer(loaded.model, session=session).adapter.vision_blocks(loaded.model)[0].attention.q_proj
    with pytest.raises(IncompatiblePassError, match="at least one head"):
        Optimizer(loaded.model, session=session).apply(ViTPruneConfig(heads=2))  # the tiny tower has 2 heads
    fused = tiny("tiny:llava")
    Optimizer(fused.model, session=session).apply(QKVFuseConfig(vision_tower=True)).model  # noqa: B018
    with pytest.raises(IncompatiblePassError, match="plain nn.Linear"):
        Optimizer(fused.model, session=session).apply("vit-prune")
    opt = Optimizer(loaded.model, session=session).apply("vit-prune")
    with pytest.raises(CalibrationError):
        opt.model  # noqa: B018
    assert q_proj.out_features == 40 and "forward" not in loaded.model.__dict__
