"""Record llama.cpp's token ids for the real GGUF models into data/llamacpp_real_token_ids.json.

tests/quantize/test_tokenizer.py checks that the tokenizers rebuilt by quantize/tokenizer.py give these
ids. The texts are defined here; the ids come from llama-cpp-python's
`Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)`: special=True
because a `tokenizers` document always matches its added (control and user-defined) tokens in the text.

The script has two halves in two venvs. Under the product's venv (which has `gguf`) it hashes the models
and writes variants: metadata-only copies with one key changed (`gemma3-270m+space_prefix`: Gemma's
vocabulary with tokenizer.ggml.add_space_prefix true, as Llama 2 style SentencePiece GGUFs have it). It
then runs itself under the peers venv (bench/setup_peers, which has llama_cpp) with --tokenize to get the
ids and llama.cpp's view of the special tokens.

Run: .venv/bin/python tests/quantize/record_token_ids.py --peers-python .venv-peers/bin/python \
         gemma3-270m=PATH.gguf qwen2.5-coder-0.5b-instruct=PATH.gguf
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

OUT = Path(__file__).parent / "data" / "llamacpp_real_token_ids.json"
# variant name -> (model it copies, metadata key, new value)
VARIANTS = {"gemma3-270m+space_prefix": ("gemma3-270m", "tokenizer.ggml.add_space_prefix", True)}

TEXTS = {
    "empty": "",
    "one_space": " ",
    "english": "The quick brown fox jumps over the lazy dog.",
    "contractions": "It's 3:45pm, isn't it? We'd've gone — y'all KNOW'S it.",
    "code_python": 'def greet(name: str) -> str:\n    """Say hi."""\n    return f"héllo {name!r}"  # ünïcode\n',
    "code_c": 'int main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "chinese": "北京是中国的首都。我们今天去公园散步，天气很好！",
    "japanese_korean": "東京は日本の首都です。서울은 한국의 수도입니다.",
    "emoji": "Party 🎉🥳! Family 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, thumbs 👍🏽.",
    "space_runs": "a  b   c    d     e          end",
    "leading_spaces": "   leading spaces",
    "trailing_spaces": "trailing spaces   ",
    "newline_runs": "line one\nline two\n\nline four\n\n\n\nend\n",
    "crlf": "windows\r\nline\r\n\r\nend",
    "tabs": "col1\tcol2\t\tcol3\n\t\tindented\t",
    "mixed_whitespace": " \n \t \n\n  x \t\n",
    "digits": "1234567890 3.14159 1,000,000 0x1F 2026-12-06 v1.2.3",
    "chatml_markers": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "gemma_markers": "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "bos_eos_as_text": "<bos>text<eos> and <pad> <|endoftext|>",
    "html": "<table><tr><td>cell</td></tr></table> <b>bold</b> <div class=\"x\">",
    "html_space_inside": "<p> </p> if a> </b",  # Gemma's "> </": a token with ▁ inside
    "accented": "Crème brûlée, naïve façade, Ångström, żółć, ñandú.",
    "cyrillic_arabic_hindi": "Привет, мир! مرحبا بالعالم नमस्ते दुनिया",
    "rare_scripts": "ᚠᛇᚻ᛫ᛒᛦᚦ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q 𓀀𓁐",
    "long_words": "antidisestablishmentarianism Pneumonoultramicroscopicsilicovolcanoconiosis",
    "punctuation": "!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((())) [[[]]] {{{}}} ''' \"\"\"",
    "markdown": "# Title\n\n- item **bold** _it_\n- `code`\n\n```python\nprint(1)\n```\n",
    "json": '{"key": [1, 2.5, null, true], "nested": {"a": "b\\u00e9"}}',
    "url_email": "https://example.com/path?q=1&r=%20x user.name+tag@mail.example.org",
}


# ---- under the peers venv ---------------------------------------------------------------------------

def tokenize_all(paths: dict[str, str]) -> dict:
    """{name: {"ids": {text name: ids}, "llama_cpp": special tokens as llama.cpp sees them}}."""
    import llama_cpp  # only the peers venv has it

    result = {}
    for name, path in paths.items():
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        result[name] = {
            "ids": {t: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) for t, text in TEXTS.items()},
            "llama_cpp": {"bos": llama_cpp.llama_vocab_bos(vocab), "eos": llama_cpp.llama_vocab_eos(vocab),
                          "eot": llama_cpp.llama_vocab_eot(vocab), "add_bos": llama_cpp.llama_vocab_get_add_bos(vocab),
                          "eog": [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]},
            "llama_cpp_python": llama_cpp.__version__,
        }
    return result


# ---- under the product venv -------------------------------------------------------------------------

def metadata_copy(source: Path, target: Path, key: str, value) -> Path:
    """A tensor-free copy of source's metadata with key set to value (enough for llama.cpp's vocab_only)."""
    import gguf  # the product venv's; the peers venv has none

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value if name == key else field.contents(), field.types[0], sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def record(models: dict[str, Path], peers_python: str, scratch: Path) -> dict:
    paths = {name: str(path) for name, path in models.items()}
    for variant, (base, key, value) in VARIANTS.items():
        if base in models:
            paths[variant] = str(metadata_copy(models[base], scratch / f"{variant}.gguf", key, value))
    ran = subprocess.run([peers_python, __file__, "--tokenize", json.dumps(paths)],
                         capture_output=True, text=True, check=True)
    tokenized = json.loads(ran.stdout)
    for name, entry in tokenized.items():
        base, *_ = VARIANTS.get(name, (name,))
        entry["file"] = models[base].name
        entry["sha256"] = sha256_of(models[base])
        if name in VARIANTS:
            entry["variant"] = {"key": VARIANTS[name][1], "value": VARIANTS[name][2]}
    return tokenized


def write(models: dict) -> None:
    """The JSON with one line per text, so a re-recording diffs line by line."""
    version = next(iter(models.values()))["llama_cpp_python"]
    lines = ["{", ' "note": "Llama(model_path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)'
             '; written by tests/quantize/record_token_ids.py",',
             f' "llama_cpp_python": {json.dumps(version)},', ' "texts": {']
    lines += [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in TEXTS.items()]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" },", ' "models": {']
    for n, (name, entry) in enumerate(models.items()):
        head = {k: v for k, v in entry.items() if k not in ("ids", "llama_cpp_python")}
        lines.append(f"  {json.dumps(name)}: {json.dumps(head)[:-1]}, \"ids\": {{")
        lines += [f"   {json.dumps(k)}: {json.dumps(v)}," for k, v in entry["ids"].items()]
        lines[-1] = lines[-1].rstrip(",")
        lines.append("  }}" + ("," if n < len(models) - 1 else ""))
    lines += [" }", "}"]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json.loads(OUT.read_text(encoding="utf-8"))  # what was written must read back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenize", help=argparse.SUPPRESS)  # the peers-venv half: {name: path} as JSON
    parser.add_argument("--peers-python", default=".venv-peers/bin/python")
    parser.add_argument("models", nargs="*", metavar="NAME=PATH")
    args = parser.parse_args()
    if args.tokenize:
        print(json.dumps(tokenize_all(json.loads(args.tokenize))))
        return
    if not args.models or any("=" not in m for m in args.models):
        parser.error("give each model as NAME=PATH.gguf")
    models = {name: Path(path).expanduser() for name, path in (m.split("=", 1) for m in args.models)}
    with tempfile.TemporaryDirectory() as scratch:
        write(record(models, args.peers_python, Path(scratch)))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
