"""Text in and out: incremental detokenizing equals a full decode, stop strings never leak, chat templates render.

Most tests use the real SmolLM2 tokenizer rebuilt from the bundled GGUF (a 49k byte-level BPE whose
emoji and CJK characters really are split across tokens); the tiny test vocabulary covers a model whose
chat template, BOS and EOS are set up differently. Stop-string handling is checked against a brute-force
oracle with hypothesis, on arbitrary text chunks and on real token boundaries.

Run: .venv/bin/python -m pytest tests/agent/test_tokenizer.py -q
"""
from __future__ import annotations

import json

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.engine.tokenizer import REPLACEMENT_CHAR, StopChecker, TextTokenizer
from quantize.fetch import fetch
from quantize.checkpoint import TokenizerInfo
from quantize.tokenizer import tokenizer_from_gguf

SAMPLES = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?",
    "emoji": "Party time 🎉🥳! Family: 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin tones 👍🏽.",
    "cjk": "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "accented": "Crème brûlée, naïve façade, Ångström, Øresund, żółć, ñandú.",
    "code": 'def greet(name: str) -> str:\n    """Say hi."""\n    return f"héllo {name!r}"  # ünïcode\n\t}',
    "mixed": "résumé 📄 → 履歴書; ∑xᵢ² ≤ ∞ ✓",
}
# Text that mixes scripts and the characters most often split across byte-level tokens.
TEXT = st.text(alphabet=st.one_of(
    st.characters(codec="utf-8", exclude_categories=["Cs"]),
    st.sampled_from("aeiou ,.\n😀🎉👍🏽日本語é—‍"),
), max_size=40)


@pytest.fixture(scope="module")
def smollm_info():
    # GGUFReader parses every metadata array element, seconds for a 49k vocabulary: read it once.
    return tokenizer_from_gguf(gguf.GGUFReader(fetch("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def smollm(smollm_info) -> TextTokenizer:
    return TextTokenizer(smollm_info.tokenizer_json, smollm_info)


@pytest.fixture(scope="module")
def smollm_json(smollm_info) -> str:
    return smollm_info.tokenizer_json


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> TextTokenizer:
    return TextTokenizer(tiny_checkpoint.tokenizer.tokenizer_json, tiny_checkpoint.tokenizer)


def stream(tok: TextTokenizer, ids: list[int], stop=(), prompt_ids=()) -> tuple[list[str], str]:
    """(the text each add() returned, then flush()'s text)."""
    detok = tok.detokenizer(stop=stop, prompt_ids=prompt_ids)
    return [detok.add(i) for i in ids], detok.flush()


def oracle(text: str, stop: list[str]) -> str:
    """Text up to the stop string that is complete first (the longest, on a tie), found character by character."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            return text[:end - max(len(s) for s in hits)]
    return text


# ---- incremental detokenizing -----------------------------------------------------------------------

@pytest.mark.parametrize("name", SAMPLES)
def test_increments_concatenate_to_the_full_decode(smollm, name):
    ids = smollm.encode(SAMPLES[name])
    pieces, tail = stream(smollm, ids)
    assert "".join(pieces) + tail == smollm.decode(ids) == SAMPLES[name]
    assert tail == ""  # the text ends on a whole character, so nothing was left for flush
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_emoji_split_across_tokens_is_emitted_whole(smollm):
    ids = smollm.encode("a😀b")
    assert len(ids) > 3, "precondition: the emoji's four bytes span several tokens"
    pieces, _ = stream(smollm, ids)
    assert "😀" in pieces and REPLACEMENT_CHAR not in "".join(pieces)
    assert "" in pieces  # held back while incomplete


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_any_text_streams_to_its_decode_without_half_characters(smollm, text):
    # Compared with decode(ids), not text: SmolLM2's vocabulary lacks a few byte tokens (e.g. 0x16) and
    # has no byte fallback, so such characters are dropped or left as stray bytes when encoding.
    ids = smollm.encode(text)
    pieces, tail = stream(smollm, ids)
    assert "".join(pieces) + tail == smollm.decode(ids)
    if REPLACEMENT_CHAR not in smollm.decode(ids):
        assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_incomplete_character_at_the_end_is_flushed_with_replacement(smollm):
    ids = smollm.encode("ok 😀")[:-1]  # the emoji's last byte never arrives
    pieces, tail = stream(smollm, ids)
    assert "".join(pieces) == "ok"
    assert tail.endswith(REPLACEMENT_CHAR) and "".join(pieces) + tail == smollm.decode(ids)


def test_special_tokens_are_not_printed(smollm):
    eos = 2  # <|im_end|>
    ids = [1, *smollm.encode("assistant\nHello"), eos]
    pieces, tail = stream(smollm, ids)
    assert "".join(pieces) + tail == "assistant\nHello"
    assert smollm.is_eos(eos)


def test_prompt_context_does_not_change_the_text(smollm):
    prompt, output = smollm.encode("Résumé: 日本"), smollm.encode("語 and 😀 more")
    pieces, tail = stream(smollm, output, prompt_ids=prompt)
    assert "".join(pieces) + tail == smollm.decode(output)


def test_window_stays_small_on_long_outputs(smollm):
    detok = smollm.detokenizer()
    for i in smollm.encode(SAMPLES["english"] * 20):
        detok.add(i)
    assert detok.num_window_tokens <= 2  # the last emitted token is kept as decoder context, nothing older


# ---- stop strings -----------------------------------------------------------------------------------

def test_stop_split_across_tokens_is_never_emitted(smollm):
    text = "Answer: 42\n###\nQuestion: next"
    pieces, tail = stream(smollm, smollm.encode(text), stop=["\n###"])
    assert "".join(pieces) + tail == "Answer: 42"
    assert all("#" not in p for p in pieces)


def test_held_back_text_that_is_not_a_stop_is_released():
    checker = StopChecker(["STOP"])
    assert checker.push("go ST") == "go "
    assert checker.push("O") == ""
    assert checker.push("P!") == "" and checker.matched == "STOP"
    assert checker.push("more") == "" and checker.flush() == ""
    checker = StopChecker(["STOP"])
    assert checker.push("go STO") == "go " and checker.flush() == "STO"


def test_the_stop_that_completes_first_wins():
    checker = StopChecker(["abcd", "bc"])
    assert checker.push("xab") == "x"
    assert checker.push("cd") == "a" and checker.matched == "bc"  # "bc" ends before "abcd" does


@settings(max_examples=300, deadline=None)
@given(text=TEXT, stop=st.lists(st.text(alphabet="ab😀\n", min_size=1, max_size=4), min_size=1, max_size=4),
       where=st.integers(0, 40), data=st.data())
def test_stop_checker_matches_the_oracle_however_text_is_chunked(text, stop, where, data):
    text = text[:where] + stop[0] + text[where:] + "ab😀"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    checker = StopChecker(stop)
    emitted = "".join(checker.push(c) for c in chunks)
    expected = oracle(text, stop)
    assert (emitted if checker.stopped else emitted + checker.flush()) == expected
    assert checker.matched in stop  # stop[0] is always in the text


@settings(max_examples=150, deadline=None)
@given(text=TEXT, stop=st.text(alphabet=st.sampled_from("ab #\n😀日é"), min_size=1, max_size=5),
       where=st.integers(0, 40))
def test_stop_on_real_token_boundaries_matches_the_oracle(smollm, text, stop, where):
    ids = smollm.encode(text[:where] + stop + text[where:])
    pieces, tail = stream(smollm, ids, stop=[stop])
    assert "".join(pieces) + tail == oracle(smollm.decode(ids), [stop])  # decode: see the test above
    assert stop not in "".join(pieces) + tail


# ---- encoding and chat templates --------------------------------------------------------------------

def test_real_template_renders_chatml(smollm):
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Thanks"}]
    assert smollm.render_chat(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert smollm.render_chat(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_chat_markers_encode_as_special_tokens(smollm):
    ids = smollm.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids[-4:] == [1, *smollm.encode("assistant\n")]  # <|im_start|> is id 1
    assert smollm.decode(ids).startswith("system\n")  # the markers are special: skipped when decoding


def test_tiny_model_template_and_no_bos(tiny):
    assert tiny.render_chat([{"role": "user", "content": "the"}]) == (
        "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.encode("the")[0] != tiny.bos_token_id  # add_bos_token is false for the tiny model


def settings_for(template: str | None = None, add_bos: bool = False, bos: int | None = 1) -> TokenizerInfo:
    return TokenizerInfo(tokenizer_json="", bos_token_id=bos, eos_token_ids=(2,), add_bos_token=add_bos,
                         chat_template=template)


def make(tokenizer_json: str, template: str | None, add_bos: bool = False) -> TextTokenizer:
    """The real vocabulary with a test's own chat template and BOS setting."""
    return TextTokenizer(tokenizer_json, settings_for(template, add_bos))


def test_bos_added_once(smollm_json):
    tok = make(smollm_json, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", True)
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_bos=False)[0] != 1
    assert tok.encode_chat([{"role": "user", "content": "hi"}]).count(1) == 1


def test_trim_and_lstrip_blocks_as_hf_does(smollm_json):
    template = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n[{{ m['content'] }}]\n"
                "    {% endif %}\n{% endfor %}")
    tok = make(smollm_json, template)
    assert tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]\n[b]\n"


def test_tojson_keeps_unicode_and_markup(smollm_json):
    tok = make(smollm_json, "{{ messages[0] | tojson }}")
    assert tok.render_chat([{"role": "user", "content": "<é>"}]) == '{"role": "user", "content": "<é>"}'


@pytest.mark.parametrize("template, messages, error", [
    ("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}], "roles must alternate"),
    ("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}], "chat template failed"),
    ("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}], "chat template failed"),
    # each a template error naming its cause, never a bare 500 at the API
    ("{{ 1 / (messages | length - 1) }}", [{"role": "user", "content": "x"}], "failed.*ZeroDivisionError"),
    ("{{ range(10 ** 9) | list }}", [{"role": "user", "content": "x"}], "failed.*OverflowError"),
    ("{{ messages[0].content.index('z') }}", [{"role": "user", "content": "x"}], "failed.*ValueError"),
    ("{{ 1 }}", [{"content": "no role"}], "messages\\[0\\]"),
    (None, [{"role": "user", "content": "x"}], "no chat template"),
])
def test_template_errors_are_value_errors(smollm_json, template, messages, error):
    with pytest.raises(ValueError, match=error):
        make(smollm_json, template).render_chat(messages)


# each renders as transformers' apply_chat_template does
def test_generation_block_renders_its_body(smollm_json):
    tok = make(smollm_json, "{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
                            "{% endfor %}")
    assert tok.render_chat([{"role": "assistant", "content": "a"}]) == "[a]"


def test_tools_and_documents_are_none_and_name_is_passed(smollm_json):
    tok = make(smollm_json, "{% if tools is not none %}{{ tools | tojson }}{% endif %}{{ documents is none }}"
                            "{% for m in messages %}{{ m.name }}:{{ m['content'] }}{% endfor %}")
    assert tok.render_chat([{"role": "user", "content": "hi", "name": "ann"}]) == "Trueann:hi"


def test_template_syntax_error_fails_at_load(smollm_json):
    with pytest.raises(ValueError, match="does not compile"):
        make(smollm_json, "{% for m in messages %}")


def test_bad_tokenizer_json_and_missing_bos_are_value_errors(smollm_json):
    with pytest.raises(ValueError, match="could not be loaded"):
        TextTokenizer("{}", settings_for())
    with pytest.raises(ValueError, match="no bos_token_id"):
        TextTokenizer(smollm_json, settings_for(add_bos=True, bos=None))


def test_a_prompt_is_refused_unencoded_only_when_it_surely_holds_too_many_tokens():
    """The bound holds for SentencePiece-style documents, whose decoder strips a leading space (so a token
    can cover more than its decoded bytes): 40 spaces are 10 tokens, and max_tokens=12 is not refused as
    "at least 14"."""
    from types import SimpleNamespace

    from agent.engine.tokenizer import PromptTooLong, TextTokenizer

    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
           "pre_tokenizer": None, "post_processor": None,
           "decoder": {"type": "Sequence", "decoders": [
               {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
               {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
           "model": {"type": "BPE", "dropout": None, "unk_token": "?", "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": False,
                     "vocab": {"?": 0, "\u2581": 1, "\u2581\u2581": 2, "\u2581\u2581\u2581\u2581": 3, "a": 4},
                     "merges": [["\u2581", "\u2581"], ["\u2581\u2581", "\u2581\u2581"]]}}
    tok = TextTokenizer(json.dumps(doc), SimpleNamespace(bos_token_id=None, eos_token_ids=[0], add_bos_token=False,
                                                         chat_template=None))
    assert len(tok.encode(" " * 40, max_tokens=10)) == 10  # fits exactly: encoded, not refused
    with pytest.raises(PromptTooLong):
        tok.encode("a" * 100_000, max_tokens=10)


def test_a_long_text_is_encoded_without_holding_other_threads(smollm):
    """`tokenizers`' encode keeps the GIL, which would stall every stream (and the API's event loop) for
    ~0.5 s on a 600 kB prompt: a long text is encoded by encode_batch, which lets go of it; same ids."""
    import threading

    text = "the quick brown fox jumps over the lazy dog " * 14_000
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            stop.wait(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        before = ticks[0]
        ids = smollm.encode(text)
        during = ticks[0] - before
    finally:
        stop.set()
        ticker.join()
    assert ids == smollm._tokenizer.encode(text, add_special_tokens=False).ids
    assert during > 50, during  # ~260-300 ticks here; with the GIL held, 9


def test_a_draft_whose_tokenizer_json_is_spaced_otherwise_has_the_same_tokenizer(smollm_info):
    """The quantizer writes tokenizer.json compact; bundles built before hold the same document spaced out. A
    draft model built by either version pairs with a target built by the other; another vocabulary does not."""
    from agent.engine.draft import same_tokenizer

    compact = smollm_info.tokenizer_json
    assert ", " not in compact[:200] and ": " not in compact[:200]  # written without separator spaces
    document = json.loads(compact)
    spaced = json.dumps(document, ensure_ascii=False)
    assert spaced != compact and same_tokenizer(spaced, compact)
    document["model"]["vocab"]["<extra>"] = len(document["model"]["vocab"])
    assert not same_tokenizer(json.dumps(document, ensure_ascii=False), compact)
