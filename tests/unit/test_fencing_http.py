"""HTTP fencing: header helpers, FenceChecker semantics, the docs' WSGI service."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st

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
from tests.by_path import load_file

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"

A = Token("job-1", 7, owner="worker-a")
B = Token("job-1", 8, owner="worker-b")


def load_example(name: str) -> ModuleType:
    """Import a file of docs/examples by path, as the docs show it."""
    return load_file(f"docs_example_{name}", EXAMPLES / f"{name}.py")


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


# --- job ids that are not plain ASCII --------------------------------------------

#: job ids a header cannot carry as they are (non-latin-1, reserved, space, '%')
ODD_JOB_IDS = ["rapport-été", "订单:42", "a b/c%d"]


@pytest.mark.parametrize(
    ("job_id", "sent"),
    [
        ("rapport-été", "rapport-%C3%A9t%C3%A9"),
        ("订单:42", "%E8%AE%A2%E5%8D%95%3A42"),
        ("a b/c%d", "a%20b%2Fc%25d"),
        ("3f1c9a2e-0b7d-4e4b-9f0e-2d6c1a8b7e55", "3f1c9a2e-0b7d-4e4b-9f0e-2d6c1a8b7e55"),
        ("Az09-._~", "Az09-._~"),
    ],
)
def test_the_job_header_is_percent_encoded_utf8(job_id: str, sent: str) -> None:
    headers = fencing_headers(Token(job_id, 5))
    assert headers["Fencing-Job"] == sent
    assert headers["Idempotency-Key"] == f"{sent}:5"


@given(
    job_id=st.text(st.characters(exclude_categories=("Cs",)), min_size=1),
    generation=st.integers(1, 2**53),
)
def test_any_job_id_round_trips_through_ascii_headers(job_id: str, generation: int) -> None:
    headers = fencing_headers(Token(job_id, generation))
    assert all(value.isascii() for value in headers.values())
    assert token_from_headers(headers) == Token(job_id, generation)


def test_a_job_id_that_is_not_unicode_text_is_refused() -> None:
    with pytest.raises(LeaseConfigurationError, match="not valid Unicode"):
        fencing_headers(Token("job-\udc80", 1))


def test_lowercase_escapes_decode_to_the_same_job() -> None:
    headers = {"Fencing-Token": "3", "Fencing-Job": "rapport-%c3%a9t%c3%a9"}
    headers["Idempotency-Key"] = "rapport-%C3%A9t%C3%A9:3"
    assert token_from_headers(headers) == Token("rapport-été", 3)


def test_a_raw_job_id_with_a_colon_still_matches_its_idempotency_key() -> None:
    # a client that does not encode: ids without '%' read as they were sent
    headers = {"Fencing-Token": "3", "Fencing-Job": "report:42", "Idempotency-Key": "report:42:3"}
    assert token_from_headers(headers) == Token("report:42", 3)


@pytest.mark.parametrize(
    "headers",
    [
        {"Fencing-Token": "3", "Fencing-Job": "bad-%FF"},
        {"Fencing-Token": "3", "Fencing-Job": "ok", "Idempotency-Key": "%FF:3"},
        {"Fencing-Token": "3", "Fencing-Job": "a%20b", "Idempotency-Key": "a b c:3"},
    ],
    ids=["job-not-utf8", "key-not-utf8", "key-other-job"],
)
def test_a_job_header_that_does_not_decode_is_refused(headers: dict[str, str]) -> None:
    with pytest.raises(LeaseConfigurationError):
        token_from_headers(headers)


@pytest.mark.parametrize("job_id", ODD_JOB_IDS)
def test_checker_fences_an_odd_job_id_by_its_decoded_value(job_id: str) -> None:
    checker = FenceChecker()
    checker.check(fencing_headers(Token(job_id, 8)), resource="r")
    assert checker.storage.accepted("r") == Token(job_id, 8)
    with pytest.raises(StaleFencingToken) as refused:
        checker.check(fencing_headers(Token(job_id, 7)), resource="r")
    assert refused.value.job_id == job_id


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


@pytest.mark.parametrize("job_id", ODD_JOB_IDS)
def test_service_fences_an_odd_job_id_sent_by_httpx(
    service: tuple[str, object], job_id: str
) -> None:
    base, app = service
    newer, older = Token(job_id, 8), Token(job_id, 7)
    with httpx.Client(base_url=base, timeout=10) as client:
        written = client.put("/values/v", content=b"from 8", auth=FencingAuth(newer))
        stale = client.put("/values/v", content=b"from 7", auth=FencingAuth(older))
    assert written.status_code == 200
    assert stale.status_code == 409
    assert job_id in stale.json()["error"]
    assert app.checker.storage.accepted("v") == newer  # type: ignore[attr-defined]
    assert app.values["v"] == b"from 8"  # type: ignore[attr-defined]


@pytest.mark.parametrize("job_id", ODD_JOB_IDS)
def test_service_fences_an_odd_job_id_sent_by_requests(
    service: tuple[str, object], job_id: str
) -> None:
    base, app = service
    with fenced_requests_session(Token(job_id, 8)) as newer:
        written = newer.put(f"{base}/values/v", data=b"from 8", timeout=10)
    with fenced_requests_session(Token(job_id, 7)) as older:
        stale = older.put(f"{base}/values/v", data=b"from 7", timeout=10)
    with fenced_requests_session(Token(job_id, 8)) as retry:
        repeat = retry.put(f"{base}/values/v", data=b"again", timeout=10)
    assert written.status_code == 200
    assert stale.status_code == 409
    assert repeat.json() == {"applied": False, "generation": 8}
    assert app.checker.storage.accepted("v") == Token(job_id, 8)  # type: ignore[attr-defined]
    assert app.values["v"] == b"from 8"  # type: ignore[attr-defined]
