"""lmdq.gates.keeper: an ungated job costs no Redis call; a gated canary's last job gives the verdict."""

from __future__ import annotations

from typing import Any

import redis

from lmdq.contract import BatchStatus, JobPayload, Request, Result, ResultStatus
from lmdq.gates.config import GateConfig
from lmdq.gates.keeper import GateKeeper
from lmdq.gates.store import GateStore
from lmdq.jobs.queue import job_id_for
from lmdq.redis.keys import BatchField, Keys
from lmdq.results.store import ResultStore

BID = "batch_0123456789abcdef01234567"


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, msg: str, **kw: Any) -> None:
        self.lines.append(("info", msg, kw))

    def warning(self, msg: str, **kw: Any) -> None:
        self.lines.append(("warning", msg, kw))


def _payload(gated: bool) -> JobPayload:
    return JobPayload(batch_id=BID, model="m", job_no=0, gated=gated,
                      requests=[Request(index=0, custom_id="c0", prompt="p")])


def test_ungated_job_is_not_judged() -> None:
    keeper = GateKeeper(ResultStore(redis.Redis(port=1), keys=Keys("never")))  # no server: any call would fail
    keeper.job_ended(_payload(False), _Log())


def test_failing_canary_pauses(client: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    results = ResultStore(client, keys=keys)
    client.hset(keys.batch(BID), mapping={BatchField.status.value: BatchStatus.in_progress.value,
                                                  BatchField.total.value: 2})
    GateStore(client, keys=keys).create(BID, GateConfig(canary=1, max_empty=0),
                                        canary_job_ids=[job_id_for(BID, 0)], queue_key="", queues=[],
                                        wakes=[], ttl_s=600)
    results.write_result(Result(batch_id=BID, custom_id="c0", index=0, status=ResultStatus.completed,
                                text="", model="m"))
    log = _Log()
    GateKeeper(results).job_ended(_payload(True), log)
    assert client.hget(keys.batch(BID), "status") == b"paused"
    st = GateStore(client, keys=keys).state(BID)
    assert st is not None and st.report is not None and st.report["failures"][0]["gate"] == "empty"
    assert log.lines[0][1] == "quality gate failed: batch paused"
