"""Server pieces without a server: config, Accept negotiation, bounded decompression, error shapes."""

from __future__ import annotations

import gzip
import math
import zlib

import brotli
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
import zstandard

from helios.server.config import ConfigError, HeliosConfig, load_config
from helios.server.encodings import decode_body, parse_encodings
from helios.server.errors import ApiError, from_validation
from helios.server.metrics import HttpMetrics, Snapshot, render_prometheus, wants_json


def test_config_defaults_and_errors(tmp_path):
    assert load_config(None).server.max_body_bytes == 32 << 20
    good = tmp_path / "ok.toml"
    good.write_text('[server]\nport = 9000\napi_key = "k"\nadmission_slots = 4\n')
    cfg = load_config(good).server
    assert (cfg.port, cfg.api_key, cfg.admission_slots) == (9000, "k", 4)
    for text, needle in (("[server]\nmax_concurency = 1\n", "max_concurency"), ("[server]\nport = -1\n", "port"),
                         ("[server]\nthinking_token_budget = 0\n", "thinking_token_budget"), ("[server\n", "TOML")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    assert "server" in msgspec.json.schema(HeliosConfig)["$defs"]["HeliosConfig"]["properties"]


@pytest.mark.parametrize("query,accept,expected", [
    ({}, None, False), ({}, "*/*", False), ({}, "application/json", True),
    ({}, "text/plain, application/json", False), ({}, "application/json, text/plain", True),
    ({}, "text/plain;q=0.5, application/json", True), ({}, "application/json;q=0.2, */*;q=0.5", False),
    ({}, "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", False),
    ({"format": "json"}, "text/plain", True), ({"format": "prometheus"}, "application/json", False),
])
def test_metrics_negotiation(query, accept, expected):
    assert wants_json(query, accept) is expected


def test_metrics_bad_format_and_text():
    with pytest.raises(ValueError):
        wants_json({"format": "xml"}, None)
    text = render_prometheus(Snapshot(generated_tokens=5, graph_launches={"eager": 3, "graph": 7})).decode()
    assert "# TYPE flare_generated_tokens_total counter\nflare_generated_tokens_total 5.0\n" in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["flare_generated_tokens"].type == "counter"
    assert {s.labels["kind"]: s.value for s in families["flare_graph_launches"].samples} == {"eager": 3, "graph": 7}
    assert math.isnan(families["flare_first_response_median_seconds"].samples[0].value)
    assert msgspec.json.decode(b'{"active": 2}', type=Snapshot).generated_tokens == 0  # absent reads as zero
    m = HttpMetrics()
    for s in (0.1, 0.3, 0.2):
        m.observe_first_response(s)
    assert m.first_response().median_seconds == pytest.approx(0.2) and m.first_response().samples == 3


def test_metrics_render_the_host_lookup_histograms_and_checkpoint_counters():
    from helios.engine.host_cache import LookupHistograms
    from helios.engine.messages import Histogram

    lookups = LookupHistograms()
    for missing, transfer, prefill in ((10, 2e5, None), (300, 5e6, 9e8), (70000, 0.0, 2e10)):
        lookups.observe(missing, transfer, prefill)
    h = lookups.missing_tokens
    snap = Snapshot(host_missing_tokens=Histogram(**h), checkpoint_captures={"endpoint": 4},
                    checkpoint_skips={"storage": 1},
                    host_estimated_prefill_ns=Histogram(**lookups.prefill_ns))
    families = {f.name: f for f in text_string_to_metric_families(render_prometheus(snap).decode())}
    buckets = {s.labels["le"]: s.value for s in families["flare_host_cache_missing_tokens"].samples
               if s.name.endswith("_bucket")}
    assert buckets["16.0"] == 1 and buckets["1024.0"] == 2 and buckets["65536.0"] == 2 and buckets["+Inf"] == 3
    count = [s.value for s in families["flare_host_cache_estimated_prefill_ns"].samples if s.name.endswith("_count")]
    assert count == [2]  # the lookup before any measured prefill rate is not observed
    assert "flare_host_cache_estimated_transfer_ns" not in families  # absent: no host tier
    captures = {s.labels["role"]: s.value for s in families["flare_checkpoint_captures"].samples}
    assert captures == {"anchor": 0, "message": 0, "endpoint": 4}
    skips = {s.labels["reason"]: s.value for s in families["flare_checkpoint_skips"].samples}
    assert skips == {"unknown_cost": 0, "work_budget": 0, "storage": 1}


def test_encodings_round_trip_and_bounds():
    data = b'{"x": "' + b"y" * 5000 + b'"}'
    for coding, enc in (("gzip", gzip.compress(data)), ("deflate", zlib.compress(data)),
                        ("deflate", zlib.compress(data)[2:-4]), ("br", brotli.compress(data)),
                        ("zstd", zstandard.ZstdCompressor().compress(data))):
        assert decode_body(enc, parse_encodings(coding), 10_000) == data
        with pytest.raises(ApiError) as e:
            decode_body(enc, [coding], 1000)
        assert e.value.status == 413
    with pytest.raises(ApiError) as e:
        parse_encodings("gzip, lzma")
    assert e.value.status == 415
    assert parse_encodings("identity") == []
    with pytest.raises(ApiError) as e:
        decode_body(b"garbage", ["br"], 1000)
    assert e.value.status == 400


def test_validation_errors_name_the_param():
    class Body(msgspec.Struct):
        top_k: int = 0

    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.json.decode(b'{"top_k": 1.5}', type=Body)
    err = from_validation(e.value)
    assert (err.status, err.param) == (400, "top_k")
    assert msgspec.json.decode(err.encode())["error"]["type"] == "invalid_request_error"
