"""Issue 48: completion webhooks. A real HTTP receiver on 127.0.0.1 that checks every signature itself (its own
HMAC, not lmdq's code), a real redis-server (tests/conftest.py), sim workers: one verified event per terminal
state, also through a receiver that is down (503, connection refused) for the first three tries, and no event
id lost or doubled when the worker delivering it is SIGKILLed mid-try.

Nothing here races the wall clock: deliveries are driven by :meth:`Deliverer.run_once` (in-process) or
waited for with generous timeouts; backoffs are made small through the settings, and the tries they space
are counted, not timed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import BatchStatus
from lmdq.errors import SubmitRejected
from lmdq.redis.keys import Keys
from lmdq.submission.ledger import BatchLedger
from lmdq.submission.submit import SubmitOptions, submit_file
from lmdq.webhooks.delivery import Deliverer, DeliveryPolicy
from lmdq.webhooks.store import WebhookStore
from tests.conftest import free_port, run_cli, start_worker
from tests.helpers import write_jsonl

MODEL = "sim"


def signature_ok(secret: str, headers: Any, body: bytes) -> bool:
    """Standard Webhooks, written out here (not lmdq's code): ``v1,`` + base64(HMAC-SHA256(key, id.ts.body)),
    key = base64 after ``whsec_``; a timestamp within 5 minutes."""
    msg_id, ts = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
    if not msg_id or not ts.isdigit() or abs(time.time() - int(ts)) > 300:
        return False
    key = base64.b64decode(secret.split("_", 1)[1])
    want = base64.b64encode(hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest("v1," + want, s) for s in headers.get("webhook-signature", "").split())


class Receiver:
    """A webhook endpoint: answers the first ``fail_first`` POSTs 503, then 200 to a verified one (400 else);
    ``accepted`` keeps each event id once (a receiver's dedup). ``hold()``: the next POST waits, in flight,
    until :meth:`let_go` (``held`` is set once it waits)."""

    def __init__(self, secret: str, fail_first: int = 0, port: int = 0) -> None:
        self.secret = secret
        self.fail_first = fail_first
        self.arrivals: list[str] = []
        self.accepted: dict[str, dict[str, Any]] = {}
        self.unverified = 0
        self.held = threading.Event()
        self._release = threading.Event()
        self._release.set()
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with outer.lock:
                    outer.arrivals.append(self.headers.get("webhook-id", ""))
                    n = len(outer.arrivals)
                if not outer._release.is_set():
                    outer.held.set()
                    outer._release.wait(120)
                if n <= outer.fail_first:
                    self.send_response(503)
                elif not signature_ok(outer.secret, self.headers, body):
                    with outer.lock:
                        outer.unverified += 1
                    self.send_response(400)
                else:
                    with outer.lock:
                        outer.accepted.setdefault(self.headers["webhook-id"], json.loads(body))
                    self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/hooks/lmdq"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hold(self) -> None:
        self._release.clear()

    def let_go(self) -> None:
        self._release.set()

    def close(self) -> None:
        self.let_go()
        self.server.shutdown()
        self.server.server_close()


def allow_for(*urls: str) -> str:
    return ",".join(u.split("/hooks")[0] + "/hooks" for u in urls)


def fast(allow: str, **kw: Any) -> DeliveryPolicy:
    return DeliveryPolicy(**{"allow": allow, "backoff_s": 0.05, "backoff_max_s": 1.0, "max_tries": 10,
                             "timeout_s": 10.0, "lease_s": 30.0, "poll_s": 0.05, **kw})


def rows(n: int) -> list[dict[str, Any]]:
    return [{"custom_id": f"r{i}", "prompt": f"question {i}"} for i in range(n)]


def submit(client: redis.Redis, prefix: str, tmp: Path, url: str | None, n: int = 6, model: str = MODEL,
           **opts: Any) -> Any:
    f = write_jsonl(tmp / f"in-{time.monotonic_ns()}.jsonl", rows(n))
    batch, created = submit_file(f, SubmitOptions(model=model, allow_unknown_model=True, prefix_groups=False,
                                                  batch_size=2, webhook=url, **opts),
                                 client=client, keys=Keys(prefix), ttl_s=3600)
    assert created
    return batch


def sim_worker(client: redis.Redis, url: str, prefix: str, **settings: Any) -> None:
    """A burst sim worker in this process: returns once the queues are empty (its last webhook pass done)."""
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    s = WorkerSettings(redis_url=url, key_prefix=prefix, burst=True, health_port=0, heartbeat_ttl_s=10,
                       idle_wait_s=0, **settings)
    assert Worker(engine=SimEngine(model_name=MODEL, step_ms=0), client=client, settings=s).run() == 0


def deliver_until(d: Deliverer, done: Any, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, "no delivery in time"
        if not d.run_once():
            time.sleep(0.02)


@pytest.fixture()
def store(client: redis.Redis, prefix: str) -> WebhookStore:
    return WebhookStore(client, keys=Keys(prefix))


@pytest.fixture()
def receiver(store: WebhookStore) -> Iterator[Receiver]:
    from lmdq.webhooks.signing import new_secret

    r = Receiver(store.ensure_secret("default", new_secret()))
    yield r
    r.close()


def test_one_verified_event_per_terminal_state(tmp_path: Path, redis_url: str, client: redis.Redis, prefix: str,
                                               store: WebhookStore, receiver: Receiver) -> None:
    allow = allow_for(receiver.url)
    ledger = BatchLedger(client, keys=Keys(prefix), ttl_s=3600)
    done = submit(client, prefix, tmp_path, receiver.url)
    sim_worker(client, redis_url, prefix, webhook_allow=allow)  # its last pass delivers batch.completed
    assert ledger.get(done.id).status is BatchStatus.completed
    cancelled = submit(client, prefix, tmp_path, receiver.url)
    ledger.cancel(cancelled.id)
    expiring = submit(client, prefix, tmp_path, receiver.url, completion_window_s=1.0)
    failed = submit(client, prefix, tmp_path, receiver.url, model="nobody-serves-it")  # no worker ends it
    quiet = submit(client, prefix, tmp_path, None)  # no webhook: no event
    assert ledger.store.batches.transition(failed.id, [BatchStatus.queued, BatchStatus.in_progress],
                                           BatchStatus.failed) == "failed"
    while time.time() < (expiring.expires_at or 0) + 0.5:  # the window passes (the worker checks the server clock)
        time.sleep(0.1)
    sim_worker(client, redis_url, prefix, webhook_allow=allow)
    assert ledger.get(cancelled.id).status is BatchStatus.cancelled
    assert ledger.get(expiring.id).status is BatchStatus.expired
    assert ledger.get(quiet.id).status is BatchStatus.completed
    deliver_until(Deliverer(store, fast(allow)), lambda: len(receiver.accepted) >= 4)
    want = {done.id: "batch.completed", cancelled.id: "batch.cancelled", expiring.id: "batch.expired",
            failed.id: "batch.failed"}
    got = {e["data"]["id"]: e["type"] for e in receiver.accepted.values()}
    assert got == want
    for evt_id, e in receiver.accepted.items():
        assert e["id"] == evt_id and e["object"] == "event" and isinstance(e["created_at"], int)
    assert sorted(receiver.arrivals) == sorted(receiver.accepted)  # each exactly once, every one verified
    assert receiver.unverified == 0 and store.pending() == [] and store.dead() == {}
    # a batch that ends again (a late result after the cancel, a replayed script) makes no second event
    ledger.store.batches.transition(done.id, [BatchStatus.completed], BatchStatus.cancelled)
    assert store.pending() == []


def test_each_pause_sends_batch_paused(tmp_path: Path, client: redis.Redis, prefix: str, store: WebhookStore,
                                       receiver: Receiver) -> None:
    """Canary's quality gate pauses a batch (lmdq.gates.store.PAUSE): one batch.paused per pause, then its end."""
    from lmdq.gates.store import GateStore

    gates = GateStore(client, keys=Keys(prefix))
    batch = submit(client, prefix, tmp_path, receiver.url, model="nobody-serves-it")
    assert gates.pause(batch.id, {"why": "test"}, verdict="paused") == 1
    assert gates.pause(batch.id, {"why": "again"}, verdict="paused") == 0  # paused already: no second event
    assert gates.resume(batch.id) >= 0
    assert gates.pause(batch.id, {"why": "test"}, verdict="paused") == 1
    BatchLedger(client, keys=Keys(prefix), ttl_s=3600).cancel(batch.id)
    deliver_until(Deliverer(store, fast(allow_for(receiver.url))), lambda: len(receiver.accepted) >= 3)
    got = {i: e["type"] for i, e in receiver.accepted.items()}
    assert got == {f"evt_{batch.id}_paused_1": "batch.paused", f"evt_{batch.id}_paused_2": "batch.paused",
                   f"evt_{batch.id}_cancelled": "batch.cancelled"}
    assert len(receiver.arrivals) == 3 and store.pending() == []


@pytest.mark.parametrize("down", ["503", "refused"])
def test_a_receiver_down_for_three_tries_gets_the_event_once(down: str, tmp_path: Path, client: redis.Redis,
                                                             prefix: str, store: WebhookStore) -> None:
    from lmdq.webhooks.signing import new_secret

    secret = store.ensure_secret("default", new_secret())
    port = free_port()
    url = f"http://127.0.0.1:{port}/hooks/lmdq"
    rec = Receiver(secret, fail_first=3, port=port) if down == "503" else None
    policy = fast(allow_for(url), backoff_s=0.2)
    d = Deliverer(store, policy)
    batch = submit(client, prefix, tmp_path, url)
    BatchLedger(client, keys=Keys(prefix), ttl_s=3600).cancel(batch.id)  # it ends: one event in the outbox
    (evt,) = store.pending()
    # When each try claimed the event, on the Redis server's clock (the one the schedule is kept on), in ms as
    # the scripts count: read right after the claim, before the try's outcome schedules the next one. A claim
    # takes only events due by then, so the gaps below are the backoff itself, not a race with local timers.
    tries: list[int] = []
    claim = store.claim

    def claimed(*a: Any, **kw: Any) -> Any:
        got = claim(*a, **kw)
        if got:
            sec, usec = client.time()
            tries.append(sec * 1000 + usec // 1000)
        return got

    store.claim = claimed  # type: ignore[method-assign]
    try:
        while len(tries) < 3:  # three failed tries: 503 each, or nothing listening on the port
            if not d.run_once():
                time.sleep(0.01)
        assert store.pending() == [evt] and d.delivered == 0
        # exponential backoff: the waits before tries 2 and 3 are at least 0.2 s and 0.4 s
        assert tries[1] - tries[0] >= 200 and tries[2] - tries[1] >= 400, tries
        if rec is None:
            rec = Receiver(secret, port=port)
        deliver_until(d, lambda: store.pending() == [])
        assert list(rec.accepted) == [evt] and rec.accepted[evt]["type"] == "batch.cancelled"
        assert rec.arrivals == [evt] * (4 if down == "503" else 1) and rec.unverified == 0
        assert d.delivered == 1 and store.dead() == {}
    finally:
        if rec is not None:
            rec.close()


def test_tries_run_out_into_the_dead_set(tmp_path: Path, client: redis.Redis, prefix: str,
                                         store: WebhookStore) -> None:
    url = f"http://127.0.0.1:{free_port()}/hooks/lmdq"  # nothing ever listens
    d = Deliverer(store, fast(allow_for(url), max_tries=2, backoff_s=0.01))
    batch = submit(client, prefix, tmp_path, url)
    BatchLedger(client, keys=Keys(prefix), ttl_s=3600).cancel(batch.id)
    deliver_until(d, lambda: store.pending() == [])
    (dead,) = store.dead().values()
    assert dead["tries"] == 2 and "Connection refused" in dead["error"]


def test_a_worker_sigkilled_mid_delivery_neither_loses_nor_doubles_the_event(
        tmp_path: Path, env: dict[str, str], client: redis.Redis, prefix: str, store: WebhookStore,
        receiver: Receiver, procs: list[Any]) -> None:
    env = {**env, "LMDQ_WEBHOOK_ALLOW": allow_for(receiver.url), "LMDQ_WEBHOOK_LEASE_S": "3",
           "LMDQ_WEBHOOK_TIMEOUT_S": "60", "LMDQ_WEBHOOK_POLL_S": "0.1", "LMDQ_WEBHOOK_BACKOFF_S": "0.1"}
    worker = ["--engine", "sim", "--served-model-name", MODEL, "--sim-step-ms", "1", "--idle-wait-s", "1"]
    receiver.hold()  # the first POST stays in flight
    log1 = tmp_path / "w1.log"
    w1 = start_worker(*worker, env=env, log=log1)
    procs.append(w1)
    batch = submit(client, prefix, tmp_path, receiver.url)
    assert receiver.held.wait(120), "worker 1 never tried the event"
    # its job loop does not wait on the receiver: another batch completes meanwhile
    other = submit(client, prefix, tmp_path, None)
    ledger = BatchLedger(client, keys=Keys(prefix), ttl_s=3600)
    end = time.monotonic() + 120
    while ledger.get(other.id).status is not BatchStatus.completed:
        assert time.monotonic() < end, "a held webhook blocked the worker's jobs"
        time.sleep(0.05)
    w1.send_signal(signal.SIGKILL)  # mid-try: the POST was sent, its answer never read
    w1.wait(30)
    evt = f"evt_{batch.id}_completed"
    assert store.pending() == [evt]  # not lost: still in the outbox, leased to the dead worker
    receiver.let_go()
    w2 = start_worker(*worker, env=env, log=tmp_path / "w2.log")
    procs.append(w2)
    end = time.monotonic() + 120
    while store.pending():  # its lease lapses (3 s), worker 2 takes it again
        assert time.monotonic() < end, "the event was never delivered again"
        time.sleep(0.1)
    w2.send_signal(signal.SIGTERM)
    w2.wait(60)
    assert set(receiver.arrivals) == {evt} and len(receiver.arrivals) == 2  # the same id, tried twice
    assert list(receiver.accepted) == [evt] and receiver.unverified == 0  # one event after dedup by id
    assert store.dead() == {}
    secret = store.secret("default")
    assert secret and all(secret not in p.read_text() for p in (log1, tmp_path / "w2.log"))  # never logged


def test_the_allow_list_refuses_at_submit_in_one_line(tmp_path: Path, client: redis.Redis, prefix: str,
                                                       env: dict[str, str]) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", rows(3))
    with pytest.raises(SubmitRejected):  # not through resolve: submit_file trusts its caller's options
        from lmdq.client.options import resolve
        from lmdq.submission.settings import ProducerSettings

        resolve({"webhook": "http://10.0.0.1/x"}, ProducerSettings(webhook_allow="https://hooks.example.com"),
                model=MODEL)
    p = run_cli("producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model",
                "--webhook", "http://169.254.169.254/latest?token=abc",
                env={**env, "LMDQ_WEBHOOK_ALLOW": "https://hooks.example.com/lmdq"})
    assert p.returncode != 0
    err = p.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "--webhook" in err[0] and "LMDQ_WEBHOOK_ALLOW" in err[0] and "abc" not in err[0]
    assert client.keys(f"{prefix}:*") == []  # nothing enqueued


def test_free_port_is_refused_when_closed() -> None:
    port = free_port()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_the_http_api_per_batch_and_tenant_default(tmp_path: Path, redis_url: str, env: dict[str, str],
                                                   client: redis.Redis, prefix: str, store: WebhookStore) -> None:
    """OpenAI SDK against a real lmdq-api: alice's batches use her tenant default (LMDQ_API_WEBHOOKS), bob names
    one per batch (``extra_body``); events carry the API's batch ids, each signed with its tenant's secret, the
    end announced once the output file exists; a destination off the allow list is a 400 naming ``webhook``."""
    import openai
    from openai import OpenAI

    from lmdq.webhooks.signing import new_secret
    from lmdq_bench.api_bench import ApiProcess

    # made first (an operator's `webhook-secret`): the API keeps a tenant's secret, never replaces it
    alice_rx = Receiver(store.ensure_secret("alice", new_secret()))
    bob_rx = Receiver(store.ensure_secret("bob", new_secret()))
    keys = {"alice": "alice-key-" + "a" * 24, "bob": "bob-key-" + "b" * 24}
    api = ApiProcess(redis_url=redis_url, prefix=prefix, keys=keys, files_dir=tmp_path / "files",
                     log=tmp_path / "api.log",
                     env={"LMDQ_KNOWN_MODELS": '["sim"]', "LMDQ_WEBHOOK_POLL_S": "0.1",
                          "LMDQ_WEBHOOK_ALLOW": allow_for(alice_rx.url, bob_rx.url),
                          "LMDQ_API_WEBHOOKS": f"alice={alice_rx.url}"}).start()
    try:
        def line(i: int) -> dict[str, Any]:
            return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "sim", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4}}

        def upload(c: OpenAI, data: bytes) -> str:
            return c.files.create(file=("in.jsonl", data), purpose="batch").id

        alice = OpenAI(base_url=api.url + "/v1", api_key=keys["alice"])
        bob = OpenAI(base_url=api.url + "/v1", api_key=keys["bob"])
        good = "".join(json.dumps(line(i)) + "\n" for i in range(5)).encode()
        a = alice.batches.create(input_file_id=upload(alice, good), endpoint="/v1/chat/completions",
                                 completion_window="24h")
        b = bob.batches.create(input_file_id=upload(bob, b'{"custom_id": "x"}\nnot json\n'),
                               endpoint="/v1/chat/completions", completion_window="24h",
                               extra_body={"webhook": bob_rx.url})
        with pytest.raises(openai.BadRequestError) as refused:
            bob.batches.create(input_file_id=upload(bob, good), endpoint="/v1/chat/completions",
                               completion_window="24h", extra_body={"webhook": "http://10.1.2.3/hooks"})
        assert "LMDQ_WEBHOOK_ALLOW" in str(refused.value) and refused.value.body["param"] == "webhook"  # type: ignore[index]
        assert (store.secret("alice"), store.secret("bob")) == (alice_rx.secret, bob_rx.secret)
        assert alice_rx.secret != bob_rx.secret
        end = time.monotonic() + 120
        while alice.batches.retrieve(a.id).status == "validating":
            assert time.monotonic() < end
            time.sleep(0.05)
        assert start_worker("--engine", "sim", "--served-model-name", MODEL, "--sim-step-ms", "1", "--burst",
                            env={**env, "LMDQ_WEBHOOK_ALLOW": ""}).wait(120) == 0  # this worker may not call out
        end = time.monotonic() + 120
        while len(alice_rx.accepted) < 1 or len(bob_rx.accepted) < 1:
            assert time.monotonic() < end, "the API never delivered"
            time.sleep(0.05)
        (ae,) = alice_rx.accepted.values()
        (be,) = bob_rx.accepted.values()
        assert (ae["type"], ae["data"]["id"]) == ("batch.completed", a.id)
        assert (be["type"], be["data"]["id"]) == ("batch.failed", b.id)
        done = alice.batches.retrieve(a.id)
        assert done.status == "completed" and done.output_file_id  # told once its file existed
        assert bob.batches.retrieve(b.id).status == "failed"
        assert alice_rx.unverified == bob_rx.unverified == 0 and len(alice_rx.arrivals) == len(bob_rx.arrivals) == 1
        assert store.pending() == []
    finally:
        api.stop()
        alice_rx.close()
        bob_rx.close()
    text = (tmp_path / "api.log").read_text()
    assert alice_rx.secret not in text and bob_rx.secret not in text


def test_cli_webhook_flag_python_webhook_kwarg_and_secret_command(tmp_path: Path, redis_url: str, env: dict[str, str],
                                                                 client: redis.Redis, prefix: str,
                                                                 store: WebhookStore) -> None:
    """``submit --webhook URL`` and ``Client.submit(..., webhook=URL)`` each get their batch.completed, signed
    with the secret ``webhook-secret`` prints; ``--rotate`` replaces it."""
    import lmdq
    from lmdq.submission.settings import ProducerSettings

    secret = run_cli("producer", "webhook-secret", env=env)
    assert secret.returncode == 0, secret.stderr
    rx = Receiver(secret.stdout.decode().strip())
    try:
        allow = allow_for(rx.url)
        hook_env = {**env, "LMDQ_WEBHOOK_ALLOW": allow}
        f = write_jsonl(tmp_path / "in.jsonl", rows(4))
        p = run_cli("producer", "submit", str(f), "--model", MODEL, "--allow-unknown-model", "--json",
                    "--webhook", rx.url + "/cli", env=hook_env)
        assert p.returncode == 0, p.stderr
        cli_id = json.loads(p.stdout)["id"]
        c = lmdq.Client(redis_url, settings=ProducerSettings(key_prefix=prefix, webhook_allow=allow))
        py_id = c.submit(rows(3), model=MODEL, allow_unknown_model=True, webhook=rx.url + "/py").id
        sim_worker(client, redis_url, prefix, webhook_allow=allow)
        deliver_until(Deliverer(store, fast(allow)), lambda: len(rx.accepted) >= 2)
        assert {e["data"]["id"]: e["type"] for e in rx.accepted.values()} == {cli_id: "batch.completed",
                                                                               py_id: "batch.completed"}
        assert rx.unverified == 0 and len(rx.arrivals) == 2
        rotated = run_cli("producer", "webhook-secret", "--rotate", env=env).stdout.decode().strip()
        assert rotated.startswith("whsec_") and rotated != rx.secret == secret.stdout.decode().strip()
        assert store.secret("default") == rotated
    finally:
        rx.close()


def test_an_api_batch_tells_its_pause_under_the_api_id_and_leaves_its_end_to_the_api(
        tmp_path: Path, client: redis.Redis, prefix: str, store: WebhookStore, receiver: Receiver) -> None:
    from lmdq.gates.store import GateStore

    batch = submit(client, prefix, tmp_path, receiver.url, model="nobody-serves-it", webhook_as="batch_api123")
    assert GateStore(client, keys=Keys(prefix)).pause(batch.id, {"why": "test"}, verdict="paused") == 1
    BatchLedger(client, keys=Keys(prefix), ttl_s=3600).cancel(batch.id)  # lmdq's end: the API tells of it
    assert store.pending() == ["evt_batch_api123_paused_1"]
    deliver_until(Deliverer(store, fast(allow_for(receiver.url))), lambda: store.pending() == [])
    assert [(e["type"], e["data"]["id"]) for e in receiver.accepted.values()] == [("batch.paused", "batch_api123")]
