"""The tokenizer rebuilt from a GGUF must give llama.cpp's ids, and the HF-folder path must read its configs.

Reference ids live in data/llamacpp_token_ids.json: llama-cpp-python (built by bench/setup_peers into
.venv-peers) ran `Llama(model_path=..., vocab_only=True).tokenize(text.encode(), add_bos=False,
special=True)` on each text there. To re-record after changing the texts, run that call under
.venv-peers/bin/python for every "text" and write the ids back with the version that produced them.

Run: .venv/bin/python -m pytest tests/quantize/test_tokenizer.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from quantize.fetch import fetch
from quantize.checkpoint import CheckpointError
from quantize.tokenizer import PRE_TOKENIZERS, tokenizer_document, tokenizer_from_gguf, tokenizer_from_hf_folder

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
    assert smollm_info.eos_token_ids == (2,)  # <|im_end|> is both the GGUF's EOS and the turn end
    assert smollm_info.add_bos_token is False
    assert "<|im_start|>" in smollm_info.chat_template


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
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf", model="llama"))
    with pytest.raises(CheckpointError, match="'llama'"):
        tokenizer_from_gguf(reader)


def test_tiny_gguf_merges_and_turn_end(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    info = tokenizer_from_gguf(gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf", template=template)))
    tok = Tokenizer.from_str(info.tokenizer_json)
    # Pieces "he" and " he": "h e" merges to 256; with no merge for "Ġ h" the space stays byte token 32.
    assert tok.encode("he he<|im_end|>", add_special_tokens=False).ids == [256, 32, 256, 258]
    assert info.eos_token_ids == (257, 258)  # EOS, then the control token the template ends turns with


def test_turn_end_needs_the_template(tmp_path):
    info = tokenizer_from_gguf(gguf.GGUFReader(write_tiny_gguf(tmp_path / "t.gguf")))
    assert info.eos_token_ids == (257,)


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
