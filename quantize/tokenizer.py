"""Rebuild a checkpoint's tokenizer as one `tokenizers` JSON document, from a GGUF file or a HF folder.

A GGUF names its tokenizer in `tokenizer.ggml.model`: "gpt2" (byte-level BPE, built here) or "llama"
(SentencePiece-style, built by quantize/spm_tokenizer.py). A GGUF stores a byte-level BPE tokenizer as
data: the vocabulary, the merges, a type per token and the name of a llama.cpp pre-tokenizer
(`tokenizer.ggml.pre`). Only the name travels, so the split regexes for each supported name are kept
here, transcribed from llama.cpp's `src/llama-vocab.cpp` (`llm_tokenizer_bpe`). llama.cpp applies its
regexes one after another, each splitting the pieces left by the one before and keeping the text between
matches as pieces too: that is a chain of `Split(..., "isolated")` pre-tokenizers followed by a regex-free
ByteLevel. The result is checked token-for-token against llama.cpp in tests/quantize/test_tokenizer.py.

Convention for every TokenizerInfo made here: encode with `add_special_tokens=False` and prepend
`bos_token_id` yourself when `add_bos_token` is true (a GGUF-built document has no post-processor, so
BOS is never added twice).

Run: python -m quantize.tokenizer MODEL.gguf "some text"   # prints the ids
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader, TokenType
from tokenizers import Tokenizer

from quantize.checkpoint import CheckpointError, TokenizerInfo
from quantize.spm_tokenizer import spm_document

# The GPT-2 split. HF's ByteLevel regex ends in a further `|\s+`; llama.cpp leaves it out because it
# keeps unmatched text as pieces anyway, and a Split with "isolated" behaviour does the same.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Case-insensitive contractions: llama.cpp writes HF's `(?i:'s|...)` out as `'[sS]|...` because its
# regex engine has no inline flags; Oniguruma reads both the same.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one pre-tokenizer type (llm_tokenizer_bpe)."""

    regexes: tuple[str, ...]  # applied in order, each to the pieces the previous one left
    ignore_merges: bool = False  # a piece that is itself a vocabulary token is emitted whole
    add_bos_default: bool = False  # used only when the GGUF has no tokenizer.ggml.add_bos_token


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos_default=True)

# tokenizer.ggml.pre value -> split rules; the names are the ones llama.cpp's vocabulary loader accepts.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    "gpt-2": PreTokenizer((_GPT2,)),
    "smollm": PreTokenizer((r"\p{N}", _GPT2)),  # every digit on its own, then GPT-2
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "qwen2": PreTokenizer((_QWEN2,)),
}
SUPPORTED_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model: byte-level BPE, SentencePiece-style

# Tokens that end generation by their text, whatever the file names as EOS: llama.cpp's list (llama-vocab.cpp).
# Many chat GGUFs name only the turn end (Qwen2.5 instruct: <|im_end|>) or only the base model's end of text;
# a generator that stopped on one would run on past the other, into an invented next turn or document.
END_MARKERS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<end_of_turn>",
               "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>")


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def pre_tokenizer_for(name: str | None) -> PreTokenizer:
    """The split rules for a tokenizer.ggml.pre value; CheckpointError naming it when unsupported."""
    # llama.cpp loads a GGUF without the key (made before pre-tokenizers were recorded) as "default".
    name = "default" if name is None else name
    if name not in PRE_TOKENIZERS:
        raise CheckpointError(f"unsupported tokenizer.ggml.pre {name!r} "
                              f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    return PRE_TOKENIZERS[name]


def tokenizer_document(tokens: list[str], merges: list[str], token_types: list[int],
                       pre: PreTokenizer) -> dict:
    """A `tokenizers` JSON document (as a dict) for a byte-level BPE vocabulary in GGUF form."""
    vocab = {}
    for i, text in enumerate(tokens):
        vocab[text] = i  # a repeated string keeps its last id, as llama.cpp's token_to_id does
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, token_types),
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer_json(pre),
        "post_processor": None,  # BOS is the caller's job: see the module docstring
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": pre.ignore_merges, "vocab": vocab,
            "merges": [m.split(" ", 1) for m in merges],  # byte-level pieces never hold a real space
        },
    }


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[dict]:
    """Control and user-defined tokens, matched whole in the input before any splitting.

    llama.cpp matches the same set (with special=True) ahead of its regexes. Control tokens are
    `special` (skippable when decoding); user-defined ones are ordinary text that must stay one token.
    """
    kinds = {TokenType.CONTROL: True, TokenType.UNKNOWN: True, TokenType.USER_DEFINED: False}
    added = []
    for i, (text, kind) in enumerate(zip(tokens, token_types)):
        if kind in kinds and text:
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kinds[kind]})
    return added


def _pre_tokenizer_json(pre: PreTokenizer) -> dict:
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
              for r in pre.regexes]
    # use_regex=False: the splitting is done above; ByteLevel only maps bytes to its printable alphabet.
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level]}


def _checked_json(document: dict, source: str) -> str:
    """Serialize, and load once so a document `tokenizers` would reject fails here, naming the source.

    Compact (no spaces after separators, characters as themselves): the document ships in every bundle, and
    a 262,144-token vocabulary's (Gemma 3's, 514,847 merges) is 16.0 MB with json.dumps' default
    separators, 14.4 MB without."""
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":"))
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed document
        raise CheckpointError(f"{source}: tokenizer could not be built ({e})") from e
    return text


def _end_ids(special_ids: dict[str, int]) -> list[int]:
    """Ids of the END_MARKERS that are special (control) tokens of this vocabulary."""
    return [special_ids[m] for m in END_MARKERS if m in special_ids]


def _unique(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _gguf_document(reader: GGUFReader, model: str) -> tuple[dict, bool]:
    """The document for the GGUF's tokenizer model, and add_bos_token's default when the key is missing."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    if model == "llama":
        return _spm_document(reader, tokens, types), True  # llama.cpp adds BOS for SentencePiece by default
    pre = pre_tokenizer_for(_field(reader, "tokenizer.ggml.pre"))
    return tokenizer_document(tokens, _field(reader, "tokenizer.ggml.merges", []), types, pre), pre.add_bos_default


def _spm_document(reader: GGUFReader, tokens: list[str], types: list[int]) -> dict:
    """SentencePiece-style: llama.cpp ignores tokenizer.ggml.pre and merges, and adds the space prefix
    unless tokenizer.ggml.add_space_prefix says not to."""
    scores = _field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CheckpointError("a 'llama' (SentencePiece) tokenizer needs tokenizer.ggml.scores, one per token")
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    return spm_document(tokens, scores, _added_tokens(tokens, types),
                        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
                        unk_token=tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None)


def tokenizer_from_gguf(reader: GGUFReader) -> TokenizerInfo:
    """The GGUF's tokenizer as a TokenizerInfo; CheckpointError when its model or pre type is unsupported."""
    model = _field(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise CheckpointError(f"unsupported tokenizer.ggml.model {model!r} "
                              f"(supported: {', '.join(SUPPORTED_MODELS)})")
    document, add_bos_default = _gguf_document(reader, model)
    chat_template = _field(reader, "tokenizer.chat_template")
    special_ids = {t["content"]: t["id"] for t in document["added_tokens"] if t["special"]}
    eos_ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return TokenizerInfo(
        tokenizer_json=_checked_json(document, "GGUF"),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_unique([*eos_ids, *_end_ids(special_ids)]),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=chat_template,
    )


# ---- Hugging Face folders -------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _token_content(value) -> str | None:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict with a `content`."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    """The chat template: chat_template.jinja, chat_template.json, or tokenizer_config.json's entry.

    The config entry may be a list of named templates; the one named "default" is the chat template.
    """
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _adds_bos(document: dict, bos: str | None) -> bool:
    """Whether the document's post-processor puts BOS first (what transformers does without add_bos_token)."""
    processors = [document.get("post_processor") or {}]
    if processors[0].get("type") == "Sequence":
        processors = processors[0].get("processors", [])
    for p in processors:
        first = (p.get("single") or [{}])[0] if p.get("type") == "TemplateProcessing" else {}
        if bos is not None and first.get("SpecialToken", {}).get("id") == bos:
            return True
    return False


def _hf_eos_ids(tokenizer: Tokenizer, config: dict, generation: dict) -> list[int | None]:
    """EOS from tokenizer_config.json's token string plus generation_config.json's id (an int or a list)."""
    eos = _token_content(config.get("eos_token"))
    gen_eos = generation.get("eos_token_id")
    return [tokenizer.token_to_id(eos) if eos else None, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])]


def tokenizer_from_hf_folder(folder: Path) -> TokenizerInfo:
    """TokenizerInfo from tokenizer.json, tokenizer_config.json and (if present) generation_config.json."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: no tokenizer.json (slow-only tokenizers are not supported)")
    document = _read_json(path)
    text = _checked_json(document, str(path))
    tokenizer = Tokenizer.from_str(text)
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")
    bos = _token_content(config.get("bos_token"))
    chat_template = _hf_chat_template(folder, config)
    special_ids = {t["content"]: t["id"] for t in document.get("added_tokens", []) if t.get("special")}
    return TokenizerInfo(
        tokenizer_json=text,
        # an explicit null (Qwen) means no BOS, as transformers reads it; only a missing key falls back
        bos_token_id=(tokenizer.token_to_id(bos) if bos else None) if "bos_token" in config
        else generation.get("bos_token_id"),
        eos_token_ids=_unique([*_hf_eos_ids(tokenizer, config, generation),
                               *_end_ids(special_ids)]),
        add_bos_token=bool(config.get("add_bos_token", _adds_bos(document, bos))),
        chat_template=chat_template,
    )


if __name__ == "__main__":
    info = tokenizer_from_gguf(GGUFReader(sys.argv[1]))
    print(Tokenizer.from_str(info.tokenizer_json).encode(sys.argv[2], add_special_tokens=False).ids)
