"""Recipes: data in, data out, validated as a whole; unknown names and bad entries point at the line."""

from __future__ import annotations

import pytest

import mmsdk
from mmsdk import Optimizer, Recipe, Session
from mmsdk.core.errors import ConfigError, UnknownNameError

YAML = """\
name: fuse-all
description: fuse everything we can
steps:
  - pass: qkv-fuse
    config:
      vision_tower: true
"""


class _RecipePlugin:
    __name__ = "recipes-test"

    @staticmethod
    @mmsdk.hookimpl
    def mmsdk_register_recipes(register):
        register(Recipe.from_yaml(YAML))
        register(Recipe(name="flamingo-only", family="flamingo", steps=({"pass": "qkv-fuse"},)))


def test_yaml_recipe_applies_and_saves_back(tmp_path, tiny, session):
    path = tmp_path / "r.yaml"
    path.write_text(YAML)
    opt = Optimizer(tiny("tiny:llava").model, session=session).apply(Recipe.from_file(path))
    assert opt.results == [] and opt.model is not None
    assert opt.results[0].config.vision_tower is True
    saved = opt.recipe("shipped").save(tmp_path / "shipped.json")
    again = Recipe.from_file(saved)
    assert [s.pass_name for s in again.steps] == ["qkv-fuse"] and again.steps[0].config == {"vision_tower": True}
    assert again.family == "llava"


def test_plugin_recipes_resolve_by_name_and_family(tiny):
    session = Session.create(autoload=False, extra=[_RecipePlugin()])
    assert session.recipes.plugin_of("fuse-all") == "recipes-test"
    Optimizer(tiny("tiny:llava").model, session=session).apply("recipe:fuse-all")
    with pytest.raises(UnknownNameError, match="Unknown recipe 'flamingo-only' for a llava model"):
        Optimizer(tiny("tiny:llava").model, session=session).apply("recipe:flamingo-only")
    Optimizer(tiny("tiny:idefics").model, session=session).apply("recipe:flamingo-only")


def test_unknown_recipe_lists_the_known_ones(tiny):
    session = Session.create(autoload=False, extra=[_RecipePlugin()])
    known = "Known recipes: default, fuse-all, max-accuracy, max-memory"  # the adapter's three and the plugin's
    with pytest.raises(UnknownNameError, match=f"Did you mean 'fuse-all'.*{known}"):
        Optimizer(tiny("tiny:llava").model, session=session).apply("recipe:fuse-al")


def test_bad_entries_name_the_step_and_line(tmp_path, tiny, session):
    bad_pass = tmp_path / "bad.yaml"
    bad_pass.write_text("steps:\n  - pass: qkv-fuse\n  - pass: qkv_fuze\n")
    with pytest.raises(UnknownNameError, match=r"step 2 \(line 3\).*'qkv_fuze'.*Did you mean 'qkv-fuse'"):
        Optimizer(tiny("tiny:llava").model, session=session).apply(Recipe.from_file(bad_pass))
    bad_field = tmp_path / "field.yaml"
    bad_field.write_text("steps:\n  - pass: qkv-fuse\n    config: {vision: true}\n")
    with pytest.raises(ConfigError, match=r"step 1 \(line 2\), pass 'qkv-fuse'.*vision.*Extra inputs"):
        Optimizer(tiny("tiny:llava").model, session=session).apply(Recipe.from_file(bad_field))
    with pytest.raises(ConfigError, match="not valid YAML"):
        Recipe.from_yaml("steps: [oops")
    with pytest.raises(ConfigError, match="no 'steps' list"):
        Recipe.from_yaml("name: x\n")
