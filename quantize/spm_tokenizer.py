"""llama.cpp's SentencePiece-style tokenizer (GGUF `tokenizer.ggml.model == "llama"`) as a `tokenizers` document.

llama.cpp (`llm_tokenizer_spm` in src/llama-vocab.cpp) tokenizes each run of text between matched
control/user-defined tokens like this: optionally put a space in front (`tokenizer.ggml.add_space_prefix`),
write every space as U+2581 "▁", cut the text into UTF-8 characters, then keep joining the adjacent pair
whose concatenation is the vocabulary token of highest score (the leftmost pair on a tie); a character
that is no token is written as its `<0xXX>` byte tokens. That is BPE whose merges are every split of every
token into two tokens, ranked by the joined token's score, which is how transformers rebuilds SentencePiece
BPE merges (`generate_merges` in tokenization_utils_base.py). The document here spells those merges out,
with byte fallback, a normalizer for the escaping and a decoder that undoes it.

Equal scores are the one thing ranks cannot express: llama.cpp then joins the leftmost pair, BPE the pair
whose merge comes first. Gemma 3's normal tokens have distinct scores (falling with the id, so score order
is id order there); the ties are control and user-defined tokens, which are matched whole before any
joining, and, at score 0, the byte tokens and "▁t", whose joins never compete for the same characters.
"""
from __future__ import annotations

from collections.abc import Sequence

SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space


def token_index(tokens: Sequence[str]) -> dict[str, int]:
    """text -> id; a repeated string keeps its last id, as llama.cpp's token_to_id does."""
    return {text: i for i, text in enumerate(tokens)}


def derive_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[list[str]]:
    """Every [left, right] whose parts and concatenation are tokens, best joined score first.

    Ties in score keep the joined token's id order, then the cut from the left. A 262,144-token
    vocabulary (1.5 M characters) takes about a second.
    """
    vocab = token_index(tokens)
    ranked = [(-scores[i], i, cut) for text, i in vocab.items() for cut in range(1, len(text))
              if text[:cut] in vocab and text[cut:] in vocab]
    ranked.sort()
    return [[tokens[i][:cut], tokens[i][cut:]] for _, i, cut in ranked]


def spm_document(tokens: Sequence[str], scores: Sequence[float], added_tokens: list[dict],
                 add_space_prefix: bool, unk_token: str | None) -> dict:
    """A `tokenizers` JSON document (as a dict) that tokenizes as llama.cpp's llm_tokenizer_spm."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": normalizer_json(add_space_prefix),
        # None: llama.cpp joins pieces across the whole run of text, spaces included
        "pre_tokenizer": None,
        "post_processor": None,  # BOS is the caller's job, as for every GGUF-built document
        "decoder": decoder_json(add_space_prefix),
        "model": {
            "type": "BPE", "dropout": None, "unk_token": unk_token, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
            "vocab": token_index(tokens), "merges": derive_merges(tokens, scores),
        },
    }


def normalizer_json(add_space_prefix: bool) -> dict:
    """Spaces as ▁, and one ▁ before each run of text when the GGUF asks for it.

    `tokenizers` normalizes each run between added tokens on its own, so the prefix lands where
    llama.cpp puts it: at the start and after every control or user-defined token.
    """
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if not add_space_prefix:
        return replace
    return {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]}


def decoder_json(add_space_prefix: bool) -> dict:
    """▁ back to a space, <0xXX> tokens back to bytes, then the space the prefix added dropped."""
    steps = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
             {"type": "ByteFallback"}, {"type": "Fuse"}]
    if add_space_prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": steps}
