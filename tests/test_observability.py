"""Telemetry that leaves the container, end to end: a real server (tiny model, real vLLM engine,
a real Redis-protocol store) pushes OTLP/HTTP to a real receiver on loopback (tests/otlp_receiver.py,
decoded with opentelemetry-proto), and a real Prometheus (Debian's 2.42) scrapes its /metrics,
under a small load with everything the dashboard and the alerts watch made to happen for real:
streams, a 400, a cancel, an attach, a resume and a replay under one client traceparent, and an
outage of the store (503s and store errors).

Checked: every PromQL expression of the dashboard and of the alert rules returns data from that
Prometheus (an alert's comparison evaluated as `bool`, so its operands must have samples); the
OTLP metrics, put through the standard OTLP -> Prometheus name translation, are the names /metrics
shows and the names the dashboard and rules query; one trace per request with the spans of
shared/obs/request_traces.py, its parent the client's traceparent, the resumed, attached and
replayed requests and the cancel in their client's trace, vLLM's own `llm_request` span joined.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.dashboard_shot import render
from tests.conftest import WITHOUT_ENGINE, wait_until
from tests.observability_assets import (
    DASHBOARD,
    GPU_ONLY,
    RULES,
    alert_expressions,
    dashboard_queries,
    metric_names,
    with_bool_comparisons,
)
from tests.otlp_names import metrics_of, series_names
from tests.otlp_receiver import Received, otlp_receiver
from tests.prometheus_server import Prometheus, prometheus
from tests.real_server import ServerProcess, bundle_server, data_events
from tests.redis_server import RedisServer

RATE_WINDOW = "1m"  # the load and the scrapes all fall inside it
SSE = {"Accept": "text/event-stream"}
QUEUE_TREND = "deriv(sum(bundle_queued_requests)[5m:30s])"
# DASHBOARD_PNG=FILE: draw the dashboard's panels from this run's Prometheus (bench/dashboard_shot.py).
PICTURE = "DASHBOARD_PNG"


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def chat(content: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        **extra,
    }


@dataclass
class Observed:
    server: ServerProcess
    prometheus: Prometheus
    received: Received
    scrape: str  # /metrics after the load
    traces: dict[str, tuple[str, str]] = field(default_factory=dict)  # case -> (trace id, span id)


def stream(client: httpx.Client, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, list[str]]:
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        return response.status_code, data_events(response.iter_lines())


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    if os.environ.get(WITHOUT_ENGINE):
        pytest.skip("this run installs no engine")
    workdir = tmp_path_factory.mktemp("observability")
    store = RedisServer(workdir)
    store.start()
    with contextlib.ExitStack() as stack:
        stack.callback(store.stop)
        endpoint, received = stack.enter_context(otlp_receiver())
        environment = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",  # vLLM's own spans read only this
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        server = stack.enter_context(
            bundle_server(
                workdir,
                environment,
                redis_url=store.url,
                scheduler_stats="true",
                engine_traces="true",
                disconnect_grace_s="5",
            )
        )
        target = server.url.removeprefix("http://")
        prom = stack.enter_context(prometheus(workdir, [target], [RULES]))
        wait_until(prom.targets_up, timeout=30)
        observed = Observed(server, prom, received, scrape="")
        started = time.time()
        with httpx.Client(base_url=server.url, timeout=120) as client:
            _load(client, observed, store)
            picture = os.environ.get(PICTURE)
            if picture:  # a longer tail of load, so the picture's rates have a shape
                for index in range(8):
                    _wave(client, f"picture-{index}", 8 * 2 ** (index % 3), named=False, max_tokens=128)
                    time.sleep(2)
            wait_until(lambda: _rates_seen(prom), timeout=30, interval=0.5)
            # The queue alert's deriv() over a 30 s-step subquery needs two steps of history.
            wait_until(lambda: bool(prom.query(QUEUE_TREND)), timeout=90, interval=1)
            observed.scrape = client.get("/metrics").text
        wait_until(lambda: _spans_arrived(received, observed), timeout=30, interval=0.2)
        if picture:
            render(prom.url, DASHBOARD, Path(picture), started, time.time())
        yield observed


def _load(client: httpx.Client, observed: Observed, store: RedisServer) -> None:
    """What the panels and alerts watch, made to happen for real."""
    _wave(client, "first", 8, named=True)
    _resume_and_replay(client, observed)
    _attach(client, observed)
    _cancel(client, observed)
    refused = client.post("/v1/chat/completions", json={**chat("too long"), "max_tokens": 10**7})
    assert refused.status_code == 400
    _store_outage(client, store)
    _wave(client, "second", 8, named=False)  # no ids: nothing waits on the store's reconnection


def _wave(client: httpx.Client, name: str, count: int, *, named: bool, max_tokens: int = 12) -> None:
    def one(index: int) -> None:
        headers = {"X-Request-Id": f"{name}-{index}"} if named and index % 2 else {}
        body = chat(f"{name} wave {index} {secrets.token_hex(4)}", max_tokens=max_tokens)
        status, events = stream(client, body, headers)
        assert status == 200 and events[-1] == "[DONE]"

    with ThreadPoolExecutor(count) as pool:
        list(pool.map(one, range(count)))


def _resume_and_replay(client: httpx.Client, observed: Observed) -> None:
    """A stream, then the same client resuming it after event 2, then reading it again whole
    (a replay), all three under one traceparent."""
    header, trace_id, span_id = traceparent()
    observed.traces["resume"] = (trace_id, span_id)
    body = chat(f"resume me {secrets.token_hex(4)}")
    headers = {"traceparent": header, "X-Request-Id": f"resume-{trace_id[:8]}", **SSE}
    status, first = stream(client, body, headers)
    assert status == 200 and first[-1] == "[DONE]"
    status, rest = stream(client, body, {**headers, "Last-Event-ID": "2"})
    assert status == 200 and rest == first[2:]
    status, again = stream(client, body, headers)
    assert status == 200 and again == first


def _attach(client: httpx.Client, observed: Observed) -> None:
    """A second reader of a running generation (same id and body), both under one traceparent."""
    header, trace_id, span_id = traceparent()
    observed.traces["attach"] = (trace_id, span_id)
    with observed.server.gate.hold(after=2) as held:
        body = chat(held.prompt(f"attach {secrets.token_hex(4)}"))
        headers = {"traceparent": header, "X-Request-Id": f"attach-{trace_id[:8]}"}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(stream, client, body, headers)
            held.wait_held()
            before = _attached(client)
            second = pool.submit(stream, client, body, headers)
            wait_until(lambda: _attached(client) > before, timeout=30)
            held.release()
            assert first.result()[1] == second.result()[1]


def _attached(client: httpx.Client) -> float:
    found = re.search(r"^bundle_attached_requests_total (\S+)$", client.get("/metrics").text, re.MULTILINE)
    assert found is not None
    return float(found.group(1))


def _cancel(client: httpx.Client, observed: Observed) -> None:
    """A held stream, cancelled by id from another request under the same traceparent."""
    header, trace_id, span_id = traceparent()
    observed.traces["cancel"] = (trace_id, span_id)
    request_id = f"cancel-{trace_id[:8]}"
    with observed.server.gate.hold(after=2) as held:
        body = chat(held.prompt(f"cancel {secrets.token_hex(4)}"), max_tokens=200)
        headers = {"traceparent": header, "X-Request-Id": request_id}
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream, client, body, headers)
            held.wait_held()
            answer = client.post(f"/v1/requests/{request_id}/cancel", headers={"traceparent": header})
            assert answer.status_code == 200, answer.text
            held.release()
            status, events = streaming.result()
    assert status == 200 and '"error"' in events[-2]


def _store_outage(client: httpx.Client, store: RedisServer) -> None:
    """The store down: requests that name an id get 503 (counted as store errors), then it is back."""
    store.stop()
    try:
        for index in range(3):
            headers = {"X-Request-Id": f"outage-{index}"}
            answer = client.post("/v1/chat/completions", json=chat("no store"), headers=headers)
            assert answer.status_code == 503, answer.text
    finally:
        store.start()


def _rates_seen(prom: Prometheus) -> bool:
    """Prometheus has scraped the whole load (the 503s and the last wave's tokens)."""
    found = prom.query('bundle_http_responses_total{code="503"} >= 3')  # born at 3: no increase() yet
    tokens = prom.query(f"sum(rate(bundle_generation_tokens_total[{RATE_WINDOW}])) > 0")
    return bool(found) and bool(tokens)


def _spans_arrived(received: Received, observed: Observed) -> bool:
    ids = {bytes.fromhex(trace_id) for trace_id, _ in observed.traces.values()}
    names = {(span.trace_id, span.name) for span in received.spans()}
    return all((trace_id, "stream end") in names or (trace_id, "decode") in names for trace_id in ids)


# --- Prometheus: every expression returns data ---------------------------------------------------
def _without_gpu(exprs: list[str]) -> list[str]:
    """On a machine without NVML the GPU gauges are absent (from /metrics and OTLP alike)."""
    return [expr for expr in exprs if not metric_names(expr) <= GPU_ONLY]


def _history(prom: Prometheus, expr: str) -> dict[str, Any]:
    """What Prometheus holds of an expression's metrics (for a failure's message)."""
    found = {name: prom.query(f"count_over_time({name}[5m])") for name in metric_names(expr)}
    return {"expr": expr, "samples": found, "up": prom.query("count_over_time(up[5m])")}


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    queries = dashboard_queries(RATE_WINDOW)
    empty = [
        _history(observed.prometheus, expr)
        for expr in _without_gpu(queries)
        if not observed.prometheus.query(expr)
    ]
    assert empty == []
    assert len(_without_gpu(queries)) >= len(queries) - 1  # only the GPU panel is left out


def test_every_alert_expression_returns_data(observed: Observed) -> None:
    empty = {
        name: _history(observed.prometheus, expr)
        for name, expr in alert_expressions().items()
        if not observed.prometheus.query(with_bool_comparisons(expr))
    }
    assert empty == {}


def test_the_load_happened_as_the_panels_show_it(observed: Observed) -> None:
    """The figures behind the panels are the load's own: 503s from the outage, a 400, a cancel."""
    query = observed.prometheus.query
    codes = {s["metric"]["code"] for s in query("sum by (code) (bundle_http_responses_total)")}
    assert {"200", "400", "503"} <= codes
    assert query('bundle_aborted_requests_total{reason="cancelled"} > 0')
    assert query('sum(bundle_store_errors_total{op="claim"}) > 0')
    assert query("bundle_ttft_sla_seconds == 0.5")
    assert query("count(bundle_kv_cache_usage_ratio >= 0 <= 1) == 1")


# --- OTLP metrics: the same names, through the standard translation ------------------------------
def _exported_series(received: Received) -> set[str]:
    with received.lock:
        latest = received.metrics[-1:]
    return {name for metric in metrics_of(latest) for name in series_names(metric)}


def _scraped_series(text: str) -> set[str]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    names = {line.split("{")[0].split(" ")[0] for line in lines}
    return {name for name in names if not name.endswith("_created")}


def test_otlp_metrics_translate_to_the_scraped_names(observed: Observed) -> None:
    exported = _exported_series(observed.received)
    scraped = _scraped_series(observed.scrape)
    assert scraped - exported == set()
    # The one difference: a summary is sent as a histogram without bounds, which adds its
    # `_bucket{le="+Inf"}` series beside the `_count` and `_sum` that /metrics has.
    assert {name.removesuffix("_bucket") for name in exported - scraped} == {
        "bundle_engine_output_wait_seconds",
        "bundle_engine_output_handling_seconds",
    }


def test_the_dashboard_and_rules_query_names_the_export_gives(observed: Observed) -> None:
    queried = set().union(*(metric_names(expr) for expr in dashboard_queries(RATE_WINDOW)))
    queried |= set().union(*(metric_names(expr) for expr in alert_expressions().values()))
    exported = _exported_series(observed.received)
    assert queried - exported - GPU_ONLY == set()
    assert len(queried) > 15


def test_otlp_resource_names_the_container(observed: Observed) -> None:
    with observed.received.lock:
        resource = observed.received.metrics[-1].resource_metrics[0].resource
    attributes = {item.key: item.value.string_value for item in resource.attributes}
    assert attributes["service.name"] == "vllm-serverless-bundle"
    assert attributes["process.pid"] == str(observed.server.process.pid)
    assert attributes["service.instance.id"] == f"{attributes['host.name']}-{attributes['process.pid']}"


# --- traces ----------------------------------------------------------------------------------------
def _trace(received: Received, trace_id: str) -> list[Any]:
    return [span for span in received.spans() if span.trace_id == bytes.fromhex(trace_id)]


def _requests(spans: list[Any]) -> list[Any]:
    posts = [span for span in spans if span.name.startswith("POST ")]
    return sorted(posts, key=lambda span: span.start_time_unix_nano)


def _children(spans: list[Any], parent: Any) -> list[str]:
    return sorted(span.name for span in spans if span.parent_span_id == parent.span_id)


def _events(span: Any) -> list[str]:
    return [event.name for event in span.events]


def _attributes(span: Any) -> dict[str, Any]:
    return {item.key: getattr(item.value, item.value.WhichOneof("value")) for item in span.attributes}


GENERATION_SPANS = ["admission", "decode", "llm_request", "queue wait", "stream end", "time to first token"]


def test_a_traced_request_is_a_child_of_the_clients_span(observed: Observed) -> None:
    trace_id, client_span = observed.traces["resume"]
    spans = _trace(observed.received, trace_id)
    started, resumed, replayed = _requests(spans)
    assert all(span.parent_span_id == bytes.fromhex(client_span) for span in (started, resumed, replayed))
    assert started.name == "POST /v1/chat/completions"
    # vLLM's own span (BUNDLE_ENGINE_TRACES) is the request span's child, like the bundle's.
    assert _children(spans, started) == GENERATION_SPANS
    attributes = _attributes(started)
    assert attributes["bundle.request_id"] == f"resume-{trace_id[:8]}"
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.usage.output_tokens"] == 12
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["http.response.status_code"] == 200


def test_a_resumed_and_a_replayed_stream_join_the_trace(observed: Observed) -> None:
    trace_id, _ = observed.traces["resume"]
    spans = _trace(observed.received, trace_id)
    _, resumed, replayed = _requests(spans)
    assert _events(resumed) == ["resume"] and _events(replayed) == ["replay"]
    assert _children(spans, resumed) == ["admission"] == _children(spans, replayed)


def test_an_attached_reader_and_a_cancel_join_their_trace(observed: Observed) -> None:
    trace_id, _ = observed.traces["attach"]
    first, second = _requests(_trace(observed.received, trace_id))
    assert _events(first) == [] and _events(second) == ["attach"]
    trace_id, _ = observed.traces["cancel"]
    spans = _trace(observed.received, trace_id)
    cancelled, cancel = _requests(spans)
    assert cancel.name == "POST /v1/requests/{request_id}/cancel" and _events(cancel) == ["cancel"]
    decode = next(span for span in spans if span.name == "decode")
    assert _attributes(decode)["bundle.outcome"] == "Cancelled"


def test_one_trace_per_request_without_a_traceparent(observed: Observed) -> None:
    """The waves' requests sent none: each is the root of a trace of its own."""
    ours = {bytes.fromhex(trace_id) for trace_id, _ in observed.traces.values()}
    roots = [
        span
        for span in observed.received.spans()
        if span.name == "POST /v1/chat/completions" and span.trace_id not in ours
    ]
    assert len(roots) >= 16 + 3 + 1  # two waves, the outage's 503s, the 400
    assert len({span.trace_id for span in roots}) == len(roots)
    assert all(span.parent_span_id == b"" for span in roots)
    waves = [span for span in roots if _attributes(span)["http.response.status_code"] == 200]
    assert len(waves) >= 16  # two waves of 8 (more with DASHBOARD_PNG)
    spans = observed.received.spans()
    for root in waves:
        mine = [span for span in spans if span.trace_id == root.trace_id]
        assert _children(mine, root) == GENERATION_SPANS


def test_no_prompt_or_output_text_in_any_span(observed: Observed) -> None:
    trace_id, _ = observed.traces["resume"]
    for span in _trace(observed.received, trace_id):
        for value in _attributes(span).values():
            assert "resume me" not in str(value)
