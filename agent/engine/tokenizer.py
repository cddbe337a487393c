"""Text in and out of the engine: encode prompts, render chat templates, and stream generated text safely.

`TextTokenizer` wraps the bundle's `tokenizers` JSON document (byte-level BPE: encoded without the
document's own special tokens, BOS added here when the model config says so) and its Jinja chat template,
rendered in a sandbox the way HF transformers renders it. `IncrementalDetokenizer` turns token ids into
text one at a time using the prefix/read offsets of vLLM and TGI: each step decodes only a few tokens, and
a step whose text ends in U+FFFD (half of a multi-byte character) emits nothing until the character is
complete. Its `StopChecker` holds back text that might be the start of a stop string, so a client never
sees part of one. Nothing here does I/O.

Example:
    tok = TextTokenizer(bundle.tokenizer_json(), bundle.config)
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    detok = tok.detokenizer(stop=params.stop)
    for token_id in generated:  print(detok.add(token_id), end="")
    print(detok.flush())
"""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Protocol

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from agent.engine.logprobs import token_byte_table
from agent.process import return_free_heap, trim_heap

REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode puts where a character's bytes are incomplete
# Prompt tokens that seed a detokenizer's window (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): a
# Metaspace decoder drops the leading space of a window's first token, so the first generated token
# needs a few tokens before it. Byte-level decoders do not need them but are not harmed.
PROMPT_CONTEXT_TOKENS = 5
# `tokenizers` takes ~500 bytes a token while it encodes (offsets, token strings), and glibc keeps what it
# freed: a few 4 MB prompts at once take a 350 MB agent past 2 GB, and it stays over 1 GB.
# Texts this long are encoded one at a time, without holding the GIL, and the heap is trimmed after each.
BIG_TEXT_BYTES = 64 << 10
TOKEN_BYTES_SLACK = 4  # see TextTokenizer._max_token_bytes
# Parsing a tokenizer document takes ~25x its size at the peak, and glibc keeps what the parse freed: Gemma 3's
# 16 MB document left the process at 456 MB, 127 MB once trimmed. Past this size the heap is trimmed after it.
BIG_DOCUMENT_CHARS = 4 << 20
_big_encode = threading.Lock()


class PromptTooLong(ValueError):
    """The text holds more tokens than allowed, known without encoding it all."""


class TokenizerSettings(Protocol):
    """What TextTokenizer needs from a wire.ModelConfig or a quantize TokenizerInfo (both have these)."""

    bos_token_id: int | None
    eos_token_ids: Sequence[int]
    add_bos_token: bool
    chat_template: str | None


# ---- chat templates ---------------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    # HF templates call this to refuse a conversation (e.g. roles that do not alternate).
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # HF replaces Jinja's tojson, which escapes <, > and & for HTML, and keeps non-ASCII text as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # templates that print today's date (Llama 3.1) call this


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body: transformers' AssistantTracker uses it to mark
    assistant tokens for training (TRL's assistant-only loss writes it into fine-tunes' templates); rendering a
    prompt, it does nothing."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled as HF transformers does; ValueError on a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile: {e.message} (template line {e.lineno})") from e


def _check_messages(messages: Sequence[dict]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {m!r:.80}")


# ---- the tokenizer ----------------------------------------------------------------------------------

class TextTokenizer:
    """A model's tokenizer and chat template, with the BOS and EOS conventions of its config."""

    def __init__(self, tokenizer_json: str, config: TokenizerSettings):
        try:
            self._tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed document
            raise ValueError(f"tokenizer JSON could not be loaded: {e}") from e
        if len(tokenizer_json) > BIG_DOCUMENT_CHARS:
            return_free_heap()  # the parse's transient heap, which glibc would otherwise keep in RSS for good
        if config.add_bos_token and config.bos_token_id is None:
            raise ValueError("add_bos_token is set but the model has no bos_token_id")
        self.bos_token_id = config.bos_token_id
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.add_bos_token = config.add_bos_token
        self._template = compile_chat_template(config.chat_template) if config.chat_template else None
        self.chat_template_source = config.chat_template or ""
        # The names templates print, e.g. llama's '{{ bos_token }}'; '' when the model has none.
        self.bos_token = self._token_text(config.bos_token_id)
        self.eos_token = self._token_text(config.eos_token_ids[0] if config.eos_token_ids else None)
        self.max_token_bytes = self._max_token_bytes()

    def _max_token_bytes(self) -> int:
        """The most input one token can stand for (~35 ms for SmolLM2's 49,152 tokens): a text of n bytes is at
        least n / this many tokens, so a prompt far too long is refused unencoded. A byte-level document
        without a normalizer decodes each token to exactly its input (81 bytes at most for SmolLM2). Otherwise
        a decoded token can be shorter than its input (Metaspace strips a space, NFC composes), so the longer
        of that and its vocabulary string, with a slack of 4."""
        t, n = self._tokenizer, self._tokenizer.get_vocab_size()
        decoded = max((len(t.decode([i], skip_special_tokens=False).encode()) for i in range(n)), default=1)
        if t.normalizer is None and isinstance(t.decoder, decoders.ByteLevel):
            return max(decoded, 1)
        spelled = max((len((t.id_to_token(i) or "").encode()) for i in range(n)), default=1)
        return TOKEN_BYTES_SLACK * max(decoded, spelled, 1)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tokenizer.id_to_token(token_id) or "")

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes (agent.engine.logprobs.token_byte_table), built on first use."""
        return token_byte_table(self._tokenizer)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def added_token_id(self, content: str) -> int | None:
        """The id of the added token spelled content (outside the BPE vocabulary), or None."""
        token_id = self._tokenizer.token_to_id(content)
        return token_id if token_id in self._tokenizer.get_added_tokens_decoder() else None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids

    def encode(self, text: str, add_bos: bool | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids of text; BOS first when add_bos (default: the config's add_bos_token). PromptTooLong
        when the text is surely over max_tokens before it is encoded (the caller checks the exact count)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if max_tokens is not None and size > max_tokens * self.max_token_bytes:
            raise PromptTooLong(f"the prompt has at least {-(-size // self.max_token_bytes)} tokens ({size} bytes); "
                                f"at most {max_tokens} are accepted")
        if size < BIG_TEXT_BYTES:
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        else:  # encode_batch lets go of the GIL (encode keeps it: a 600 kB text stalled every stream 0.54 s)
            with _big_encode:
                ids = self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
                trim_heap()
        add = self.add_bos_token if add_bos is None else add_bos
        return [self.bos_token_id, *ids] if add else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens (EOS, chat markers) left out."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> str:
        """The prompt text for an OpenAI-style message list (tools: OpenAI's tool definitions, for templates that
        list them); ValueError when the template refuses it."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        try:
            # tools and documents as transformers passes them: None when there are none (templates test
            # `tools is not none`)
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         tools=list(tools) if tools else None, documents=None)
        except Exception as e:  # the bundle's template on these messages: TemplateError, TypeError (None + str),
            # ZeroDivisionError, the sandbox's OverflowError for a huge range(): the request's answer, not a 500
            raise ValueError(f"chat template failed to render the messages: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    max_tokens: int | None = None, tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat; BOS added per config unless the template already wrote it."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        ids = self.encode(text, add_bos=False, max_tokens=max_tokens)
        if self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def detokenizer(self, stop: Sequence[str] = (), prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, stop, prompt_ids)


# ---- stop strings -----------------------------------------------------------------------------------

def first_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the occurrence in text that ends first (the longer one on a tie), or None.

    Ending first is what a stream sees first, so the answer does not depend on how text was chunked.
    """
    hits = [(i + len(s), i, s) for s in stop if (i := text.find(s)) >= 0]
    if not hits:
        return None
    _, start, s = min(hits)
    return start, s


def held_suffix_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a prefix of some stop string (it may yet become one)."""
    longest = min(len(text), max((len(s) - 1 for s in stop), default=0))
    for n in range(longest, 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stop):
            return n
    return 0


class StopChecker:
    """Streams text through, holding back what could be the start of a stop string.

    Once a stop string appears, the text before it is released and nothing after: not the stop string,
    not what followed it (OpenAI API: "the returned text will not contain the stop sequence").
    """

    def __init__(self, stop: Sequence[str]):
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.matched: str | None = None  # the stop string that ended the text
        self._pending = ""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> str:
        """The part of pending + text that is safe to emit now."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        hit = first_stop(buffer, self.stop)
        if hit is not None:
            start, self.matched = hit
            self._pending = ""
            return buffer[:start]
        cut = len(buffer) - held_suffix_length(buffer, self.stop)
        self._pending = buffer[cut:]
        return buffer[:cut]

    def flush(self) -> str:
        """At the end of the text: what was held back, since it never became a stop string."""
        text, self._pending = self._pending, ""
        return text


# ---- incremental detokenizer ------------------------------------------------------------------------

class IncrementalDetokenizer:
    """Token ids in, one at a time; text out that is whole characters and never part of a stop string.

    Window: ids[prefix:read] were decoded and emitted last step (context for the decoder),
    ids[read:] are new. A step emits decode(ids[prefix:])[len(decode(ids[prefix:read])):] unless that
    ends in U+FFFD, i.e. a character still missing bytes. Ids before `prefix` are dropped, so the work
    and memory per token are bounded by the window, not the length of the output.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = (), prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._stops = StopChecker(stop)
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix, self._read = 0, len(self._ids)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched

    @property
    def num_window_tokens(self) -> int:
        """Ids kept for decoding: the last emitted token(s) as context plus any still held back."""
        return len(self._ids)

    def add(self, token_id: int) -> str:
        """The new text safe to emit after token_id ('' when held back, and always after a stop)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        return self._stops.push(self._complete_text())

    def flush(self) -> str:
        """At the end of generation: all held-back text (an incomplete character as U+FFFD), up to any stop."""
        if self.stopped:
            return ""
        text = self._stops.push(self._new_text())
        self._advance()
        return text if self.stopped else text + self._stops.flush()

    def _new_text(self) -> str:
        """Text of ids[read:], decoded in the context of ids[prefix:read]."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix:self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix:])
        return full_text[len(prefix_text):]

    def _complete_text(self) -> str:
        """_new_text() if it ends on a whole character (then the window moves on), else ''."""
        text = self._new_text()
        if not text or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new (a skipped special token) or a character still missing bytes
        self._advance()
        return text

    def _advance(self) -> None:
        # prefix moves to read and read to the end; ids before the new prefix are no longer needed.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
