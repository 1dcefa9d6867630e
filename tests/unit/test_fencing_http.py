"""HTTP fencing: header helpers, FenceChecker semantics, the docs' WSGI service."""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import requests

from celery_leases.errors import LeaseConfigurationError, LeaseLost, StaleFencingToken
from celery_leases.fencing import MemoryFences, Token
from celery_leases.fencing.http import (
    FenceChecker,
    FencingAuth,
    fenced_httpx_client,
    fenced_requests_session,
    fencing_headers,
    token_from_headers,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"

A = Token("job-1", 7, owner="worker-a")
B = Token("job-1", 8, owner="worker-b")


def load_example(name: str) -> ModuleType:
    """Import a file of docs/examples by path, as the docs show it."""
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- header helpers ----------------------------------------------------------


def test_fencing_headers_carry_generation_job_and_idempotency_key() -> None:
    assert fencing_headers(A) == {
        "Fencing-Token": "7",
        "Fencing-Job": "job-1",
        "Idempotency-Key": "job-1:7",
    }


def test_idempotency_key_header_equals_the_token_key() -> None:
    assert fencing_headers(A)["Idempotency-Key"] == A.idempotency_key


@pytest.mark.parametrize(
    "token",
    [Token("", 3), Token("job", 0), Token("job", -1), Token("job", True)],
)
def test_fencing_headers_reject_an_invalid_token(token: Token) -> None:
    with pytest.raises(LeaseConfigurationError):
        fencing_headers(token)


def test_token_round_trips_through_headers() -> None:
    assert token_from_headers(fencing_headers(A)) == Token("job-1", 7)


def test_token_from_headers_ignores_header_case() -> None:
    headers = {"fencing-token": "9", "FENCING-JOB": "j"}
    assert token_from_headers(headers) == Token("j", 9)


def test_token_from_headers_reads_a_wsgi_environ() -> None:
    environ = {"HTTP_FENCING_TOKEN": "12", "HTTP_FENCING_JOB": "j", "REQUEST_METHOD": "PUT"}
    assert token_from_headers(environ) == Token("j", 12)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Fencing-Token": "7"},
        {"Fencing-Job": "job-1"},
        {"Fencing-Token": "seven", "Fencing-Job": "job-1"},
        {"Fencing-Token": "0", "Fencing-Job": "job-1"},
        {"Fencing-Token": "7", "Fencing-Job": "job-1", "Idempotency-Key": "job-1:8"},
    ],
)
def test_token_from_headers_rejects_missing_or_malformed_headers(
    headers: dict[str, str],
) -> None:
    with pytest.raises(LeaseConfigurationError):
        token_from_headers(headers)


def test_fencing_auth_adds_headers_to_an_httpx_request() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        client.post("http://service.test/x", auth=FencingAuth(A))
    assert seen[0].headers["Fencing-Token"] == "7"
    assert seen[0].headers["Fencing-Job"] == "job-1"
    assert seen[0].headers["Idempotency-Key"] == "job-1:7"


def test_fencing_auth_adds_headers_to_a_requests_request() -> None:
    prepared = requests.Request("POST", "http://service.test/x", auth=FencingAuth(B)).prepare()
    assert prepared.headers["Fencing-Token"] == "8"
    assert prepared.headers["Idempotency-Key"] == "job-1:8"


def test_fenced_httpx_client_sends_the_headers_on_every_request() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["Fencing-Token"])
        return httpx.Response(204)

    with fenced_httpx_client(B, transport=httpx.MockTransport(handler)) as client:
        client.get("http://service.test/a")
        client.put("http://service.test/b")
    assert seen == ["8", "8"]


def test_fenced_requests_session_carries_fencing_auth() -> None:
    session = fenced_requests_session(A)
    prepared = session.prepare_request(requests.Request("PUT", "http://service.test/x"))
    assert prepared.headers["Fencing-Job"] == "job-1"
    session.close()


def test_missing_http_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(LeaseConfigurationError, match=r"celery-leases\[http\]"):
        fenced_httpx_client(A)


# --- FenceChecker ------------------------------------------------------------


def test_checker_refuses_the_worked_example() -> None:
    checker = FenceChecker()
    checker.check(fencing_headers(B), resource="r")
    with pytest.raises(StaleFencingToken) as refused:
        checker.check(fencing_headers(A), resource="r")
    assert refused.value.accepted == 8
    assert refused.value.generation == 7
    assert refused.value.resource == "r"
    assert refused.value.job_id == "job-1"


def test_checker_accepts_newer_generations_and_reports_previous() -> None:
    checker = FenceChecker()
    first = checker.check(fencing_headers(A), resource="r")
    second = checker.check(fencing_headers(B), resource="r")
    assert (first.applied, first.previous) == (True, None)
    assert (second.applied, second.previous) == (True, 7)


def test_checker_fences_each_resource_apart() -> None:
    checker = FenceChecker()
    checker.check(fencing_headers(B), resource="r1")
    assert checker.check(fencing_headers(A), resource="r2").applied


def test_repeat_is_applied_by_default() -> None:
    checker = FenceChecker()
    checker.check(fencing_headers(A), resource="r")
    assert checker.check(fencing_headers(A), resource="r").applied


def test_repeat_is_refused_when_asked() -> None:
    checker = FenceChecker(on_repeat="refuse")
    checker.check(fencing_headers(A), resource="r")
    with pytest.raises(StaleFencingToken, match="repeats are refused") as refused:
        checker.check(fencing_headers(A), resource="r")
    assert refused.value.accepted == 7


def test_repeat_is_a_reported_no_op_when_accepted() -> None:
    checker = FenceChecker(on_repeat="accept")
    checker.check(fencing_headers(A), resource="r")
    repeat = checker.check(fencing_headers(A), resource="r")
    assert repeat.applied is False
    assert repeat.previous == 7


def test_same_generation_of_another_job_is_refused() -> None:
    checker = FenceChecker()
    checker.check(fencing_headers(Token("job-1", 7)), resource="r")
    with pytest.raises(StaleFencingToken):
        checker.check(fencing_headers(Token("job-2", 7)), resource="r")


def test_bad_on_repeat_is_a_configuration_error() -> None:
    with pytest.raises(LeaseConfigurationError, match="on_repeat"):
        FenceChecker(on_repeat="sometimes")  # type: ignore[arg-type]


def test_checker_uses_the_given_storage() -> None:
    storage = MemoryFences()
    FenceChecker(storage).check(fencing_headers(B), resource="r")
    assert storage.accepted("r") == Token("job-1", 8)


def test_concurrent_checks_accept_a_strictly_increasing_sequence() -> None:
    """Many threads, shuffled generations: accepted ones only ever go up (I5)."""
    checker = FenceChecker(on_repeat="refuse")
    accepted: list[int] = []
    log_lock = threading.Lock()
    start = threading.Barrier(8)

    def writer(offset: int) -> None:
        start.wait()
        for generation in range(1 + offset, 400, 8):
            try:
                headers = fencing_headers(Token("j", generation))
                with checker.fenced(headers, resource="r") as result, log_lock:
                    accepted.append(result.generation)
            except StaleFencingToken:
                pass

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert accepted == sorted(set(accepted))
    assert accepted[-1] == 399


# --- the docs' WSGI service ---------------------------------------------------


@pytest.fixture
def service() -> Iterator[tuple[str, object]]:
    example = load_example("fenced_service")
    app = example.ValueService()
    server, thread = example.serve_in_thread(app)
    try:
        yield f"http://127.0.0.1:{server.server_port}", app
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_service_refuses_a_stale_writer_with_409(service: tuple[str, object]) -> None:
    base, _ = service
    with httpx.Client(base_url=base, timeout=10) as client:
        newer = client.put("/values/report", content=b"from 8", auth=FencingAuth(B))
        stale = client.put("/values/report", content=b"from 7", auth=FencingAuth(A))
        stored = client.get("/values/report")
    assert newer.status_code == 200
    assert newer.json() == {"applied": True, "generation": 8}
    assert stale.status_code == 409
    assert stale.json()["accepted"] == 8
    assert stored.json() == {"value": "from 8"}


def test_service_accepts_a_retry_without_writing_again(service: tuple[str, object]) -> None:
    base, app = service
    with httpx.Client(base_url=base, timeout=10) as client:
        client.put("/values/v", content=b"first", auth=FencingAuth(A))
        retry = client.put("/values/v", content=b"second", auth=FencingAuth(A))
    assert retry.status_code == 200
    assert retry.json()["applied"] is False
    assert app.values["v"] == b"first"  # type: ignore[attr-defined]


def test_service_answers_400_without_a_token(service: tuple[str, object]) -> None:
    base, _ = service
    with httpx.Client(base_url=base, timeout=10) as client:
        response = client.put("/values/v", content=b"x")
    assert response.status_code == 400
    assert "Fencing-Token" in response.json()["error"]


class LostLease:
    """A lease whose local safe deadline has passed (as ``Lease.check`` reports)."""

    job_id = "job-1"
    owner = "worker-a"
    generation = 7

    def check(self) -> None:
        raise LeaseLost(
            "the safe deadline passed",
            job_id="job-1",
            owner="worker-a",
            generation=7,
            reason="deadline",
        )


def test_a_locally_lost_lease_is_stopped_before_sending() -> None:
    with pytest.raises(LeaseLost):
        fencing_headers(LostLease())


def test_a_locally_lost_lease_does_not_move_a_fence() -> None:
    fences = MemoryFences()
    with pytest.raises(LeaseLost):
        fences.advance("r", LostLease())
    assert fences.accepted("r") is None
