"""Which INT4 recipe a build gets: the model's row of quantize.recipes by its geometry, under the options given,
and QuantSpec's (SmolLM2-measured) defaults for every model without a row."""
from __future__ import annotations

import json

import gguf
import pytest
from click.testing import CliRunner

from quantize import cli, recipes
from quantize.fetch import fetch
from quantize.gguf_reader import read_geometry
from quantize.precision import QuantSpec
from quantize.recipes import RECIPES, Recipe, build_spec, recipe_for


def tiny_recipe(g, **int4) -> Recipe:
    return Recipe("tiny", g.architecture, g.hidden_size, g.num_layers, g.vocab_size, int4)


def test_every_recipe_is_a_valid_int4_spec_of_its_own_geometry():
    for r in RECIPES:
        spec = QuantSpec(precision="int4", **r.int4)
        assert spec.model_dump() != QuantSpec(precision="int4").model_dump(), r.model  # a row that changes nothing
    assert len({(r.architecture, r.hidden_size, r.num_layers, r.vocab_size) for r in RECIPES}) == len(RECIPES)


@pytest.mark.parametrize("name, model", [("gemma3-270m", "gemma3-270m"),
                                         ("qwen2.5-coder-0.5b-instruct", "qwen2.5-0.5b"),
                                         ("smollm2-135m-instruct", None)])
def test_the_benchmark_models_get_their_rows_and_smollm2_the_defaults(name, model):
    path = fetch(name)
    g = read_geometry(gguf.GGUFReader(path), path)
    recipe = recipe_for(g)
    assert (recipe.model if recipe else None) == model
    if model is None:  # SmolLM2's measured recipe is QuantSpec's defaults, unchanged
        assert build_spec(g, "int4", {}) == QuantSpec(precision="int4")


def test_the_recipe_applies_to_int4_only_and_explicit_options_win_field_by_field(tiny_checkpoint, monkeypatch):
    g = tiny_checkpoint.geometry
    assert build_spec(g, "int4", {}) == QuantSpec(precision="int4")  # no row: the defaults
    row = tiny_recipe(g, block_size=128, block_sizes={"down": 64, "gate_up": 32}, embedding="int4",
                      int4_int8_layers={"down": [0]})
    monkeypatch.setattr(recipes, "RECIPES", (row,))
    spec = build_spec(g, "int4", {})
    assert (spec.block_size, spec.block_sizes, spec.embedding, spec.int4_int8_layers) == (
        128, {"down": 64, "gate_up": 32}, "int4", {"down": [0]})
    spec = build_spec(g, "int4", {"block_size": 32, "block_sizes": {"down": 128}, "int4_int8_layers": {}})
    assert (spec.block_size, spec.block_sizes, spec.embedding, spec.int4_int8_layers) == (
        32, {"down": 128, "gate_up": 32}, "int4", {})
    assert build_spec(g, "int8", {"block_size": 32}) == QuantSpec(precision="int8", block_size=32)


def test_edge_quantize_build_uses_the_models_recipe_under_its_flags(tiny_gguf, tiny_checkpoint, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(recipes, "RECIPES", (tiny_recipe(tiny_checkpoint.geometry, block_size=32,
                                                         block_sizes={"down": 32}, embedding="int4"),))

    def quant(*flags: str) -> dict:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        r = CliRunner().invoke(cli.cli, ["build", str(tiny_gguf), "--no-eval", "--method", "rtn", *flags,
                                         "--out", str(out)])
        assert r.exit_code == 0, r.output
        return json.loads((out / "model_config.json").read_text())["quant"]

    q = quant()
    assert (q["block_size"], q["block_sizes"], q["embedding"]) == (32, {"down": 32}, "int4")
    q = quant("--block-size", "16", "--embedding", "int8")
    assert (q["block_size"], q["block_sizes"], q["embedding"]) == (16, {"down": 32}, "int8")
    q = quant("--precision", "int8")
    assert (q["block_size"], q["block_sizes"], q["embedding"]) == (32, {"down": 32}, None)


def test_untied_tables_take_their_own_block_sizes(tiny_checkpoint):
    """Qwen's recipe stores the embedding in blocks of 128 and GPTQs the lm_head in blocks of 32, apart from the
    layers' block size; unset, both follow block_size as before."""
    from quantize.checkpoint import Checkpoint
    from quantize.graph import build_graph

    c = tiny_checkpoint
    untied = Checkpoint(c.geometry.model_copy(update={"tie_word_embeddings": False}),
                        c.weights | {"lm_head.weight": c.lm_head.copy()}, c.tokenizer, c.source_sha256, c.source_name)

    def report(**kw) -> list[str]:
        spec = QuantSpec(precision="int4", method="rtn", embedding="int4", lm_head="int4", block_size=16, **kw)
        return [line for line in build_graph(untied, spec)[1] if "embed" in line or "lm_head" in line]

    assert report() == ["embed_tokens: int4 block 16", "/lm_head: int4 rtn block 16 asym"]
    assert report(embedding_block_size=32, head_block_size=64) == ["embed_tokens: int4 block 32",
                                                                   "/lm_head: int4 rtn block 64 asym"]
