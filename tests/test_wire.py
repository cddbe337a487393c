"""The wire's closed sets and bounded ids against what the agent and the quantizer make: every value they
emit is one the fleet accepts, so tightening agent/wire.py never makes a current device's telemetry refused.

Run: .venv/bin/pytest tests/test_wire.py -q
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from typing import get_args

import pytest
from pydantic import ValidationError

from agent import wire
from agent.config import TelemetryConfig
from agent.engine.sequence import FinishReason as EngineFinishReason
from agent.link.store import TelemetryStore
from agent.link.telemetry import DB_NAME, Telemetry
from quantize.precision import Precision as QuantizePrecision


def figures(reason: str = "stop") -> wire.RequestFigures:
    return wire.RequestFigures(prompt_tokens=8, completion_tokens=2, queue_ms=1.0, ttft_ms=10.0,
                               prefill_tokens_per_s=400.0, decode_tokens_per_s=20.0, itl_p50_ms=50.0,
                               itl_p95_ms=60.0, e2e_ms=100.0, kv_bytes=1 << 20, finish_reason=reason)


def test_the_closed_sets_are_the_engines_and_the_quantizers():
    assert {r.value for r in EngineFinishReason} == set(wire.FINISH_REASONS)
    assert get_args(QuantizePrecision) == get_args(wire.Precision)
    for reason in EngineFinishReason:
        assert figures(reason.value).finish_reason == reason.value


def test_the_agents_boot_ids_and_versions_fit():
    assert all(re.fullmatch(wire.BOOT_ID_PATTERN, str(uuid.uuid4())) for _ in range(100))
    record = wire.TelemetryRecord(boot_id=str(uuid.uuid4()), seq=0, ts=1.0, kind="request", request=wire.RequestRecord(
        model="smollm2-135m-instruct", version="int4-b64a-src-3f2a9c1d", figures=figures()))
    assert wire.TelemetryRecord.model_validate_json(record.model_dump_json()) == record


def test_what_the_docs_call_closed_sets_or_ids_is_refused():
    good = wire.TelemetryRecord(boot_id="b", seq=1, ts=1.0, kind="request", request=wire.RequestRecord(
        model="m", version="v", figures=figures()))
    cases = {"finish_reason": ("request", "figures", "finish_reason", "invented"), "seq": ("seq", "7"),
             "boot_id": ("boot_id", "b" * 65), "model": ("request", "model", "m" * 65),
             "version": ("request", "version", "a@b")}
    for field, (*path, value) in cases.items():
        body = good.model_dump(mode="json")
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(ValidationError, match=field):
            wire.TelemetryRecord.model_validate_json(json.dumps(body))


def test_a_bundle_named_before_names_were_checked_serves_without_telemetry_rows_and_says_so_once(tmp_path, caplog):
    """Manifests are not checked when read (bundles built before must load); its requests must not make the
    finished-request hook raise (a traceback per request) nor reach the fleet to be refused there."""
    telemetry = Telemetry(TelemetryStore(tmp_path / DB_NAME, "dev-1"), TelemetryConfig(state_dir=tmp_path))
    caplog.set_level(logging.WARNING, logger="agent.link.telemetry")
    for _ in range(3):
        telemetry.record_request("SmolLM2 135M", "int4-aaaa", figures())
    telemetry.record_request("smollm2", "int4-aaaa", figures())
    assert [r.record.request.model for r in telemetry.store.unsent(10)] == ["smollm2"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "agent.link.telemetry"]
    assert "'SmolLM2 135M'@'int4-aaaa'" in line and "--name" in line
    telemetry.store.close()


def test_a_request_records_its_adapter_and_one_without_stays_readable_by_fleets_from_before_adapters():
    """A record without an adapter leaves the key out (older fleets forbid unknown keys); one with it round-trips."""
    plain = wire.RequestRecord(model="m", version="v", figures=figures())
    assert "adapter" not in json.loads(plain.model_dump_json())
    assert wire.RequestRecord.model_validate_json('{"model": "m", "version": "v", "figures": '
                                                  + figures().model_dump_json() + "}") == plain
    adapted = wire.RequestRecord(model="m", version="v", figures=figures(), adapter="support-bot@r8-3f2a9c1d")
    batch = wire.TelemetryBatch(device_id="d", records=[wire.TelemetryRecord(boot_id="b", seq=1, ts=1.0, kind="request",
                                                                             request=adapted)])
    assert wire.TelemetryBatch.model_validate_json(batch.model_dump_json()).records[0].request.adapter == adapted.adapter
    for bad in ("support-bot", "a@b@c", "../x@v"):
        with pytest.raises(ValidationError, match="adapter"):
            wire.RequestRecord(model="m", version="v", figures=figures(), adapter=bad)
