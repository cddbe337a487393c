"""Per-model INT4 recipes: the measured mix of bit widths and block sizes for a model whose size is known.

QuantSpec's defaults are the recipe measured on SmolLM2-135M, and every model without a row here gets them.
A recipe belongs to a model size, not to an architecture (quantize.architectures): what has to give to reach
llama.cpp Q4_0's size depends on how much of the model its vocabulary tables are (Qwen2.5-0.5B's untied
151,936 x 896 embedding and lm_head are 43 % of its weights, Gemma 3 270M's one tied 262,144 x 640 table 63 %,
SmolLM2-135M's tied 49,152 x 576 one 21 %). So a row is keyed by the geometry that names a model size
(architecture, hidden size, layers, vocabulary), whatever the file: a GGUF or a Hugging Face folder of the
model, under any name, gets its row; a fine-tune of it (the same geometry) too.

A recipe sets QuantSpec fields for INT4 builds; options given explicitly (edge-quantize build's flags) win
over it field by field, and per-kind block sizes merge kind by kind. Each row's figures are the "int4
default" rows of docs/benchmarks.md (bench/quality.py --model NAME).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.wire import Geometry
from quantize.precision import Precision, QuantSpec


@dataclass(frozen=True)
class Recipe:
    model: str  # the model it was measured on, as bench/benchmodels.py names it
    architecture: str  # Geometry's fields that identify the model size
    hidden_size: int
    num_layers: int
    vocab_size: int
    int4: dict[str, Any]  # QuantSpec fields over its defaults, for --precision int4

    def matches(self, g: Geometry) -> bool:
        return (g.architecture, g.hidden_size, g.num_layers, g.vocab_size) == (
            self.architecture, self.hidden_size, self.num_layers, self.vocab_size)


RECIPES: tuple[Recipe, ...] = (
    # Q4_0 keeps its token_embd at 4 bits (and its lm_head at 8): both 151,936 x 896 tables at 8 bits put the
    # SmolLM2 recipe at 499 MB against Q4_0's 428.7. Both at 4 bits (the lookup table in blocks of 128, which
    # cost nothing measurable, the head GPTQ'd in blocks of 32) pay for the projections that measured most per
    # MB at 8 bits: every layer's down (mean KL 0.0744 -> 0.0615 for 52 MB) and o (0.0615 -> 0.0576 for 9.6 MB);
    # every qkv at 8 bits gained nothing (0.0610 for 12 MB). Measured with a harness that swaps one setting at a
    # time; the figures of the whole recipe are bench/quality.py's.
    Recipe("qwen2.5-0.5b", "qwen2", 896, 24, 151936, {
        "embedding": "int4", "embedding_block_size": 128, "lm_head": "int4", "head_block_size": 32,
        "int4_int8_layers": {"qkv": [18], "o": list(range(24)), "down": list(range(24))}}),
    # The tied 262,144 x 640 table is 63 % of the weights and every decode step reads it as the head: stored once
    # at 4 bits (symmetric blocks of 32, GPTQ'd as the head) it is 105 MB against the 8-bit table's 173, and ONNX
    # Runtime's prepacked copy of it shrinks alike. That alone cost KL (mean 0.2037 with the layers in blocks of
    # 128, 0.1929 in the default 64, against 0.1381 for the 8-bit table with blocks of 128); every layer's down
    # and o at 8 bits buys it back (0.1400) at 214.3 MB against Q4_0's 241.4 (bench/quality.py, 2026-12-07).
    Recipe("gemma3-270m", "gemma3", 640, 18, 262144, {
        "embedding": "int4", "lm_head": "int4", "head_block_size": 32,
        "int4_int8_layers": {"down": list(range(18)), "o": list(range(18))}}),
)


def recipe_for(g: Geometry) -> Recipe | None:
    return next((r for r in RECIPES if r.matches(g)), None)


def build_spec(g: Geometry, precision: Precision, explicit: dict[str, Any]) -> QuantSpec:
    """The QuantSpec a build uses: for INT4 the model's recipe (if it has one) under the fields given in
    explicit; block_sizes merge per kind (an explicit down block size keeps the recipe's others)."""
    recipe = recipe_for(g) if precision == "int4" else None
    fields = dict(recipe.int4) if recipe else {}
    for key, value in explicit.items():
        fields[key] = fields.get(key, {}) | value if key == "block_sizes" else value
    return QuantSpec(precision=precision, **fields)
