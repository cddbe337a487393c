"""The tokenizer rebuilt from a GGUF must give llama.cpp's ids, and the HF-folder path must read its configs.

Reference ids for the real models (Gemma 3 270M's SentencePiece vocabulary, also with the space prefix
turned on; Qwen2.5-Coder's byte-level BPE with the qwen2 split) live in data/llamacpp_real_token_ids.json,
written by tests/quantize/record_token_ids.py (its docstring says how to re-record). SmolLM2's live in
data/llamacpp_token_ids.json: llama-cpp-python (built by bench/setup_peers into
.venv-peers) ran `Llama(model_path=..., vocab_only=True).tokenize(text.encode(), add_bos=False,
special=True)` on each text there. To re-record after changing the texts, run that call under
.venv-peers/bin/python for every "text" and write the ids back with the version that produced them.

Run: .venv/bin/python -m pytest tests/quantize/test_tokenizer.py -q
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from quantize.fetch import fetch
from quantize.checkpoint import CheckpointError
from quantize.spm_tokenizer import decoder_json, normalizer_json
from quantize.tokenizer import (PRE_TOKENIZERS, TokenizerInfo, tokenizer_document, tokenizer_from_gguf,
                                tokenizer_from_hf_folder)

REFERENCE = Path(__file__).parent / "data" / "llamacpp_token_ids.json"
CASES = json.loads(REFERENCE.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def smollm_reader() -> gguf.GGUFReader:
    # GGUFReader parses every metadata array element, seconds for a 49k vocabulary: read it once.
    return gguf.GGUFReader(fetch("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def smollm_info(smollm_reader):
    return tokenizer_from_gguf(smollm_reader)


@pytest.fixture(scope="module")
def smollm(smollm_info) -> Tokenizer:
    return Tokenizer.from_str(smollm_info.tokenizer_json)


@pytest.mark.real_model
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_ids_match_llama_cpp(smollm, case):
    assert smollm.encode(case["text"], add_special_tokens=False).ids == case["ids"]


@pytest.mark.real_model
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_decode_inverts_encode(smollm, case):
    ids = smollm.encode(case["text"], add_special_tokens=False).ids
    assert smollm.decode(ids, skip_special_tokens=False) == case["text"]


@pytest.mark.real_model
@pytest.mark.parametrize("pre", ["gpt-2", "default", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_match_llama_cpp(smollm_reader, pre):
    """SmolLM's vocabulary split by another llama.cpp pre type, against llama.cpp on a GGUF so relabelled."""
    fields = [smollm_reader.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "merges", "token_type")]
    tok = Tokenizer.from_str(json.dumps(tokenizer_document(*fields, PRE_TOKENIZERS[pre])))
    wrong = {c["name"]: tok.encode(c["text"], add_special_tokens=False).ids for c in CASES
             if tok.encode(c["text"], add_special_tokens=False).ids != c["ids_by_pre"][pre]}
    assert wrong == {}


@pytest.mark.real_model
def test_special_ids_and_template(smollm_info):
    assert smollm_info.bos_token_id == 1
    assert smollm_info.eos_token_ids == (2, 0)  # the GGUF's EOS <|im_end|>, then <|endoftext|>, as llama.cpp stops
    assert smollm_info.add_bos_token is False
    assert "<|im_start|>" in smollm_info.chat_template


# ---- the real models: Gemma 3 270M (SentencePiece) and Qwen2.5-Coder 0.5B (byte-level BPE, qwen2) ----

REAL = json.loads((Path(__file__).parent / "data" / "llamacpp_real_token_ids.json").read_text(encoding="utf-8"))
TEXTS = REAL["texts"]
REAL_MODELS = ["gemma3-270m", "qwen2.5-coder-0.5b-instruct"]
# What TokenizerInfo must say. llama.cpp's own end-of-generation set is wider: it adds tokens by their
# text alone (Gemma: <end_of_turn> 106 and </s> 212; Qwen: <|endoftext|> and the FIM markers), while
# we add a turn end only when the chat template writes it, and Gemma 3 270M's GGUF has no template.
SPECIAL = {
    "gemma3-270m": {"bos": 2, "eos": (1, 106), "add_bos": True, "template_marker": None},  # 106: <end_of_turn>
    "qwen2.5-coder-0.5b-instruct": {"bos": 151643, "eos": (151645, 151643), "add_bos": False,  # <|endoftext|>
                                    "template_marker": "<|im_start|>"},
}


@dataclass(frozen=True)
class RealModel:
    name: str
    reader: gguf.GGUFReader
    info: TokenizerInfo
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def load_real():
    """name -> RealModel, each built once: reading Gemma's 262,144-token metadata alone takes ~10 s. Module-scoped:
    the three readers and tokenizers hold ~1.5 GB, which would stay in the process for the rest of a full run."""
    @functools.cache
    def load(name: str) -> RealModel:
        reader = gguf.GGUFReader(fetch(name))
        info = tokenizer_from_gguf(reader)
        return RealModel(name, reader, info, Tokenizer.from_str(info.tokenizer_json))
    return load


@pytest.fixture(scope="module", params=REAL_MODELS)
def real(request, load_real) -> RealModel:
    return load_real(request.param)


@pytest.fixture(scope="module")
def gemma_space_prefix(load_real) -> Tokenizer:
    """Gemma's vocabulary as a GGUF with add_space_prefix true would build it (Llama 2 style SentencePiece):
    the flag changes only the normalizer and the decoder."""
    document = json.loads(load_real("gemma3-270m").info.tokenizer_json)
    document["normalizer"], document["decoder"] = normalizer_json(True), decoder_json(True)
    return Tokenizer.from_str(json.dumps(document))


def added_texts(tok: Tokenizer) -> list[str]:
    return [t.content for t in tok.get_added_tokens_decoder().values()]


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_real_ids_match_llama_cpp(real, text):
    assert real.tokenizer.encode(TEXTS[text], add_special_tokens=False).ids == REAL["models"][real.name]["ids"][text]


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_real_decode_inverts_encode(real, text):
    ids = real.tokenizer.encode(TEXTS[text], add_special_tokens=False).ids
    assert real.tokenizer.decode(ids, skip_special_tokens=False) == TEXTS[text]


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_space_prefix_ids_match_llama_cpp(gemma_space_prefix, text):
    """A ▁ before every run of text, the first and each one after a control or user-defined token."""
    want = REAL["models"]["gemma3-270m+space_prefix"]["ids"][text]
    assert gemma_space_prefix.encode(TEXTS[text], add_special_tokens=False).ids == want


@pytest.mark.real_model
def test_space_prefix_is_dropped_when_decoding(gemma_space_prefix):
    """Only the first prefix is dropped (as llama.cpp does), so texts with added tokens inside do not round-trip."""
    added = added_texts(gemma_space_prefix)
    plain = {name: t for name, t in TEXTS.items() if not any(a in t for a in added)}
    decoded = {name: gemma_space_prefix.decode(gemma_space_prefix.encode(t, add_special_tokens=False).ids)
               for name, t in plain.items()}
    assert len(plain) >= 10 and decoded == plain


@pytest.mark.real_model
def test_real_special_ids(real):
    expected, llama_cpp = SPECIAL[real.name], REAL["models"][real.name]["llama_cpp"]
    assert real.info.bos_token_id == expected["bos"] == llama_cpp["bos"]
    assert real.info.add_bos_token is expected["add_bos"] is llama_cpp["add_bos"]
    assert real.info.eos_token_ids == expected["eos"]
    assert real.info.eos_token_ids[0] == llama_cpp["eos"] and set(real.info.eos_token_ids) <= set(llama_cpp["eog"])
    marker = expected["template_marker"]
    assert real.info.chat_template is None if marker is None else marker in real.info.chat_template


@pytest.mark.real_model
def test_gemma_vocabulary_builds_in_seconds(load_real):
    reader = load_real("gemma3-270m").reader
    start = time.perf_counter()
    tokenizer_from_gguf(reader)
    assert time.perf_counter() - start < 20  # ~3 s: 514,847 merges derived from 262,144 tokens, then loaded once


# ---- a tiny GGUF written in the test ----------------------------------------------------------------

def byte_level_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for bytes: printable Latin-1 maps to itself, the rest from U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path, pre: str = "gpt-2", model: str = "gpt2", template: str | None = None) -> Path:
    """A metadata-only GGUF: 256 byte tokens, one merge, <|endoftext|> as EOS and <|im_end|> as control."""
    tokens = [*byte_level_alphabet(), "he", "<|endoftext|>", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["h e"])
    writer.add_eos_token_id(257)
    if template:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf", pre="made-up-pre"))
    with pytest.raises(CheckpointError, match="made-up-pre"):
        tokenizer_from_gguf(reader)


def test_unsupported_tokenizer_model_is_named(tmp_path):
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf", model="made-up-model"))
    with pytest.raises(CheckpointError, match="'made-up-model'"):
        tokenizer_from_gguf(reader)


def test_tiny_gguf_merges_and_turn_end(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    info = tokenizer_from_gguf(gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf", template=template)))
    tok = Tokenizer.from_str(info.tokenizer_json)
    # Pieces "he" and " he": "h e" merges to 256; with no merge for "Ġ h" the space stays byte token 32.
    assert tok.encode("he he<|im_end|>", add_special_tokens=False).ids == [256, 32, 256, 258]
    assert info.eos_token_ids == (257, 258)  # EOS, then the control token the template ends turns with


def test_end_markers_end_generation_without_a_template_too(tmp_path):
    """As in llama.cpp: a control token spelled like an end of turn or text ends generation whatever the template
    says (a base model's completion stops at <|im_end|> as a chat's does)."""
    info = tokenizer_from_gguf(gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf")))
    assert info.eos_token_ids == (257, 258)


SPM_BYTES = [f"<0x{b:02X}>" for b in range(256)]
SPM_TOKENS = ["<unk>", "<s>", "</s>", *SPM_BYTES, "▁", "a", "b", "c", "ab", "bc", "▁a"]
SPM_FIRST_PIECE = 3 + 256


def write_tiny_spm_gguf(path: Path, add_space_prefix: bool | None = None, scores: bool = True) -> Path:
    """A metadata-only SentencePiece GGUF. "ab" has the lower id but "bc" the better score."""
    types = ([gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * 6)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_types(types)
    if scores:
        writer.add_token_scores([0.0] * SPM_FIRST_PIECE + [-1.0, -2.0, -3.0, -4.0, -9.0, -5.0, -6.0])
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_spm(tmp_path: Path, add_space_prefix: bool | None = None) -> tuple[TokenizerInfo, Tokenizer]:
    info = tokenizer_from_gguf(gguf.GGUFReader(write_tiny_spm_gguf(tmp_path / "t.gguf", add_space_prefix)))
    return info, Tokenizer.from_str(info.tokenizer_json)


def test_tiny_spm_joins_the_best_scored_pair_first(tmp_path):
    _, tok = tiny_spm(tmp_path, add_space_prefix=False)
    assert tok.encode("abc", add_special_tokens=False).tokens == ["a", "bc"]  # not "ab" "c": "bc" scores higher
    assert tok.encode("ab a", add_special_tokens=False).tokens == ["ab", "▁a"]


def test_tiny_spm_writes_unknown_characters_as_bytes(tmp_path):
    _, tok = tiny_spm(tmp_path, add_space_prefix=False)
    ids = tok.encode("aé</s>", add_special_tokens=False).ids
    assert [tok.id_to_token(i) for i in ids] == ["a", "<0xC3>", "<0xA9>", "</s>"]
    assert tok.decode(ids, skip_special_tokens=False) == "aé</s>"


def test_tiny_spm_space_prefix_defaults_on(tmp_path):
    """llama.cpp's defaults for a SentencePiece GGUF without the keys: a space prefix, and BOS."""
    info, tok = tiny_spm(tmp_path)
    assert tok.encode("a</s>b", add_special_tokens=False).tokens == ["▁a", "</s>", "▁", "b"]
    assert tok.decode(tok.encode("a b", add_special_tokens=False).ids) == "a b"
    assert info.add_bos_token is True


def test_spm_without_scores_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores"):
        tokenizer_from_gguf(gguf.GGUFReader(write_tiny_spm_gguf(tmp_path / "t.gguf", scores=False)))


# ---- a Hugging Face folder --------------------------------------------------------------------------

def test_hf_folder(tmp_path, smollm_info):
    (tmp_path / "tokenizer.json").write_text(smollm_info.tokenizer_json, encoding="utf-8")
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|endoftext|>",
              "chat_template": "{{ m }}<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    info = tokenizer_from_hf_folder(tmp_path)
    assert info.bos_token_id == 1
    assert info.eos_token_ids == (0, 5, 2)
    assert info.add_bos_token is False
    assert info.chat_template == "{{ m }}<|im_end|>"


@pytest.mark.parametrize("config, bos", [
    ({"bos_token": None}, None),  # Qwen's: no BOS, though generation_config has one (found in review)
    ({}, 0),  # no bos_token at all: generation_config's
])
def test_hf_folder_bos_null_means_none(tmp_path, smollm_info, config, bos):
    (tmp_path / "tokenizer.json").write_text(smollm_info.tokenizer_json, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0}))
    assert tokenizer_from_hf_folder(tmp_path).bos_token_id == bos


def test_hf_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        tokenizer_from_hf_folder(tmp_path)
