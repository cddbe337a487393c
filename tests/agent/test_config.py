"""Config files: the shipped sample validates; unknown keys and bad values are errors that name the key."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = Path(__file__).parent.parent.parent / "systemd" / "agent.toml"


def check(path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.service.cli", "check-config", "--config", str(path), *flags],
                          capture_output=True, text=True, timeout=60)


def test_shipped_sample_is_valid():
    r = check(SAMPLE, "--syntax-only")  # its model and state directory are the device's
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_unknown_key_lists_the_allowed_ones_and_bad_value_its_range(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text('[engine]\nmemory_budget_mb = 10\nmax_queu = 3\n[api]\nsocket_mode = "0999"\n')
    r = check(bad)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "engine.max_queu: unknown key (allowed here: threads, memory_budget_mb" in r.stderr
    assert "engine.memory_budget_mb: Input should be greater than or equal to 64" in r.stderr
    assert "api.socket_mode" in r.stderr


def test_toml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text("model = 1\n[engine\n")
    r = check(bad)
    assert r.returncode != 0 and "line 2" in r.stderr and "Traceback" not in r.stderr


def test_check_config_finds_what_serve_would_refuse_here(tmp_path, tiny_fp32_bundle):
    """Found in review: a model path that was not there and a socket group that did not exist passed
    check-config, and serve then failed at once."""
    bad = tmp_path / "bad.toml"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    bad.write_text(f'model = "{tmp_path / "nowhere"}"\n[api]\nsocket_group = "no-such-group-xyz"\n'
                   f'socket = "{a_file / "api.sock"}"\n[telemetry]\nstate_dir = "{a_file / "state"}"\n'
                   f'[updates]\ntrusted_keys = ["{tmp_path / "missing.pub"}"]\n')
    r = check(bad)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "serve would refuse it on this machine" in r.stderr
    for needle in ("model: not a readable bundle", "no-such-group-xyz", "updates.trusted_keys",
                   f"telemetry.state_dir: {a_file} is not a directory", f"api.socket: {a_file} is not a directory"):
        assert needle in r.stderr, r.stderr
    assert check(bad, "--syntax-only").returncode == 0
    good = tmp_path / "good.toml"
    good.write_text(f'model = "{tiny_fp32_bundle.path}"\n[telemetry]\nstate_dir = "{tmp_path / "state"}"\n')
    r = check(good)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    # found in review: an int8 KV cache asked of a bundle without that graph stopped serve at start
    assert not (tiny_fp32_bundle.path / "model.int8kv.onnx").exists()
    good.write_text(good.read_text().replace("[telemetry]", '[engine]\nkv_dtype = "int8"\n[telemetry]'))
    r = check(good)
    assert r.returncode == 1 and 'engine.kv_dtype: "int8" needs the bundle\'s int8 KV cache graph' in r.stderr, r.stderr


def test_check_config_refuses_a_draft_model_serve_cannot_load(tmp_path, tiny_fp32_bundle):
    """speculative = "draft" with a bundle that carries no draft model: serve would refuse to start, and so
    does check-config."""
    config = tmp_path / "agent.toml"
    config.write_text(f'model = "{tiny_fp32_bundle.path}"\n[engine]\nspeculative = "draft"\n'
                      f'[telemetry]\nstate_dir = "{tmp_path / "state"}"\n')
    r = check(config)
    assert r.returncode == 1 and 'engine.speculative: "draft" needs a bundle that carries a draft model' in r.stderr
    assert f"{tiny_fp32_bundle.path} carries none" in r.stderr, r.stderr


def test_check_config_takes_speculative_draft_for_a_bundle_that_carries_its_draft(tmp_path, tiny_checkpoint,
                                                                                 tiny_fp32_bundle):
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    pair = build_bundle(tiny_checkpoint, QuantSpec(), tmp_path / "pair", name="tiny", progress=lambda s: None,
                        draft=tiny_fp32_bundle.path)
    config = tmp_path / "agent.toml"
    config.write_text(f'model = "{pair.path}"\n[engine]\nspeculative = "draft"\n'
                      f'[telemetry]\nstate_dir = "{tmp_path / "state"}"\n')
    r = check(config)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_check_config_counts_min_context_only_up_to_the_models_context(tmp_path, tiny_fp32_bundle):
    """Found in review: the budget floor took min_context as it was written, while the engine needs at most
    the model's context (or max_context), so check-config refused configs that serve starts with."""
    config = tmp_path / "agent.toml"
    config.write_text(f'model = "{tiny_fp32_bundle.path}"\n[engine]\nmemory_budget_mb = 64\nmin_context = 10000000\n'
                      f'[telemetry]\nstate_dir = "{tmp_path / "state"}"\n')
    r = check(config)
    assert r.returncode == 0, r.stderr


@pytest.mark.real_model
def test_check_config_refuses_a_budget_below_the_weights(tmp_path, real_q4_bundle):
    """Found in review: check-config said ok to memory_budget_mb = 64 for SmolLM2 INT4 (~100 MB of weights),
    and serve then refused to start."""
    config = tmp_path / "agent.toml"
    body = (f'model = "{real_q4_bundle.path}"\n[engine]\nmemory_budget_mb = {{}}\n'
            f'[telemetry]\nstate_dir = "{tmp_path / "state"}"\n')
    config.write_text(body.format(64))
    r = check(config)
    assert r.returncode == 1 and "engine.memory_budget_mb: 64 MB cannot hold the model's weights" in r.stderr, r.stderr
    config.write_text(body.format(1024))
    assert check(config).returncode == 0


def test_a_config_file_that_is_not_utf8_is_named_not_an_internal_error(tmp_path):
    """Found in review: the codec's message named no file; check-config even called it an internal error."""
    bad = tmp_path / "agent.toml"
    bad.write_bytes(b'model = "\xff"\n')
    r = check(bad)
    assert r.returncode == 1 and f"{bad}: not UTF-8 text" in r.stderr and "internal error" not in r.stderr, r.stderr


def test_the_updates_artifacts_url_must_be_http(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text('[updates]\nartifacts_url = "ftp://fleet.example"\n')
    r = check(bad, "--syntax-only")
    assert r.returncode != 0 and "updates.artifacts_url" in r.stderr and "http://" in r.stderr, r.stderr
