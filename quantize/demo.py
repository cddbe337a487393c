"""The main job, as far as the product goes today: bundle the real model at three precisions and use them.

Builds fp32, INT8 and INT4 bundles of the bundled SmolLM2 under bundles/ (reusing any that already
verify), prints their size and quality against fp32, and greedily continues a chat prompt with each.
Later issues extend this into the full agent + fleet demo.

Run: ./.ci/demo
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from agent.bundle import BundleError, open_bundle
from quantize.bundled import bundled_gguf_path
from quantize.checkpoint import load_checkpoint
from quantize.cli import default_eval_text
from quantize.evaluate import greedy
from quantize.package import build_bundle, encode
from quantize.precision import QuantSpec

BUNDLES = Path("bundles")
CHAT = [{"role": "user", "content": "Give me three tips for staying focused while studying."}]


def ensure_bundle(ckpt_loader, precision: str):
    out = BUNDLES / f"smollm2-{precision}"
    try:
        return open_bundle(out)
    except BundleError:
        pass
    print(f"==> building the {precision} bundle", flush=True)
    return build_bundle(ckpt_loader(), QuantSpec(precision=precision), out, name="smollm2-135m-instruct",
                        force=True, eval_text=default_eval_text(), progress=lambda s: print(f"    {s}", flush=True))


def chat_prompt(bundle) -> list[int]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment().from_string(bundle.config.chat_template)
    return encode(bundle.tokenizer_json(), template.render(messages=CHAT, add_generation_prompt=True))


def main() -> int:
    gguf = bundled_gguf_path()
    cache = {}
    loader = lambda: cache.setdefault("ckpt", load_checkpoint(gguf))  # noqa: E731  (load once, only if needed)
    from tokenizers import Tokenizer

    for precision in ("fp32", "int8", "int4"):
        b = ensure_bundle(loader, precision)
        m, q = b.manifest, b.manifest.quality
        size_mb = sum(f.size_bytes for f in m.files.values()) / 1e6
        print(f"\n{m.name}@{m.version}: {size_mb:.0f} MB, perplexity {q.perplexity:.2f}, "
              f"mean KL {q.mean_kl:.4f}, top-1 {q.top1_agreement:.1%}")
        ids = chat_prompt(b)
        t0 = time.perf_counter()
        out = greedy(b.runner(), ids, 48)
        dt = time.perf_counter() - t0
        text = Tokenizer.from_str(b.tokenizer_json()).decode(out)
        print(f"  user: {CHAT[0]['content']}\n  assistant: {text.strip()}\n  ({len(out)} tokens in {dt:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
