"""Endpoints ``score`` (continuation log-likelihoods, lm-eval's loglikelihood) and ``reward``.

The model tests check the transformers engine against a DIRECT transformers computation (one unpadded
forward per pair, log-softmax, gather) on the embedded SmolLM2 and on a random-weight reward model
saved to tmp; the end-to-end test scores a 4-choice multiple-choice file through submit, a real worker
loop on a real Redis and every export, and checks it picks what the direct computation picks. Sim and
input-validation tests need no model.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from lmdq.contract import ContinuationScore, Endpoint, Request, Result, ResultStatus
from lmdq.worker.engines.base import EngineRequest
from tests.conftest import run_cli
from tests.helpers import direct_score, final_events, sim_batch_results

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- contract and input (fast)


def test_request_contract_rules() -> None:
    ok = Request(index=0, custom_id="a", prompt="Q:", endpoint=Endpoint.score, continuations=[" yes", " no"])
    assert ok.continuations == [" yes", " no"] and not ok.endpoint.generates
    with pytest.raises(ValueError, match="continuations"):
        Request(index=0, custom_id="a", prompt="Q:", endpoint=Endpoint.score)
    with pytest.raises(ValueError, match="continuations"):
        Request(index=0, custom_id="a", prompt="Q:", endpoint=Endpoint.chat, continuations=["x"])
    with pytest.raises(ValueError):
        Request(index=0, custom_id="a", prompt="Q:", endpoint=Endpoint.score, continuations=[])
    with pytest.raises(ValueError, match="reward requests need 'messages'"):
        Request(index=0, custom_id="a", prompt="Q:", endpoint=Endpoint.reward)
    r = Result(batch_id="b", custom_id="a", index=0, status=ResultStatus.completed, model="m",
               endpoint=Endpoint.score, scores=[ContinuationScore(logprob=-1.5, num_tokens=2, is_greedy=None)])
    assert Result.model_validate_json(r.model_dump_json()) == r


@pytest.mark.parametrize(("line", "where"), [
    ({"custom_id": "a", "prompt": "Q", "endpoint": "score"}, "field 'continuations': expected a list of strings"),
    ({"custom_id": "a", "prompt": "Q", "endpoint": "score", "continuations": []},
     "field 'continuations': expected at least one continuation"),
    ({"custom_id": "a", "prompt": "Q", "endpoint": "score", "continuations": "yes"},
     "field 'continuations': expected a list of strings"),
    ({"custom_id": "a", "prompt": "Q", "endpoint": "score", "continuations": ["a", 3]},
     "field 'continuations[1]': expected a string, got 3"),
    ({"custom_id": "a", "prompt": "Q", "endpoint": "score", "continuations": ["a", ""]},
     "field 'continuations[1]': expected a non-empty string"),
    ({"custom_id": "a", "prompt": "Q", "endpoint": "score", "continuations": ["x"] * 65},
     "field 'continuations': expected at most 64 continuations, got 65"),
    ({"custom_id": "a", "prompt": "Q", "continuations": ["x"]}, "field 'continuations': only endpoint 'score'"),
    ({"custom_id": "a", "prompt": "Q", "endpoint": "score", "continuations": ["x"], "params": {"temperature": 1}},
     "field 'params': endpoint 'score' samples nothing"),
    ({"custom_id": "a", "prompt": "Q", "endpoint": "reward"}, "field 'prompt': expected 'messages' for endpoint"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/score", "body": {"prompt": "Q"}},
     "field 'body.continuations': required field is missing"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/score", "body": {"prompt": "Q", "continuations": ["x"],
                                                                        "max_tokens": 3}},
     "field 'body.max_tokens': unsupported key for 'score'"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/reward", "body": {"prompt": "Q"}},
     "field 'body.prompt': unsupported key for 'reward'"),
])
def test_bad_score_lines_named_by_file_and_line(tmp_path: Path, line: dict[str, Any], where: str) -> None:
    from lmdq.submission.formats import InputError, iter_lines

    first = ({"custom_id": "ok", "prompt": "P", "endpoint": "score", "continuations": ["c"]} if "url" not in line
             else {"custom_id": "ok", "method": "POST", "url": "/v1/score", "body": {"prompt": "P",
                                                                                     "continuations": ["c"]}})
    f = _jsonl(tmp_path / "in.jsonl", [first, line])
    items = list(iter_lines(f))
    assert not isinstance(items[0], InputError), items[0]
    assert isinstance(items[1], InputError)
    assert str(items[1]).startswith(f"{f}:2: ") and where in str(items[1]), str(items[1])


def test_submit_refuses_a_bad_score_file_and_enqueues_nothing(tmp_path: Path, env: dict[str, str],
                                                              client: redis.Redis, prefix: str) -> None:
    good = {"custom_id": "a", "prompt": "Q", "endpoint": "score", "continuations": ["x"]}
    f = _jsonl(tmp_path / "bad.jsonl", [good, {**good, "custom_id": "b", "continuations": [1]}])
    p = run_cli("producer", "submit", str(f), "--allow-unknown-model", env=env)
    assert p.returncode != 0
    assert f"{f}:2: field 'continuations[0]': expected a string" in p.stderr.decode()
    assert not list(client.scan_iter(f"{prefix}*"))


def test_openai_score_and_reward_lines_parse(tmp_path: Path) -> None:
    from lmdq.submission.formats import ParsedLine, iter_lines

    f = _jsonl(tmp_path / "o.jsonl", [
        {"custom_id": "s", "method": "POST", "url": "/v1/score",
         "body": {"model": "m", "messages": FRANCE, "continuations": ["Paris", "Rome"]}},
        {"custom_id": "r", "method": "POST", "url": "/v1/reward",
         "body": {"model": "m", "messages": [*FRANCE, {"role": "assistant", "content": "Paris."}]}},
    ])
    s, r = list(iter_lines(f))
    assert isinstance(s, ParsedLine) and s.endpoint is Endpoint.score and s.continuations == ("Paris", "Rome")
    assert isinstance(r, ParsedLine) and r.endpoint is Endpoint.reward and r.messages and r.params is None


# ----------------------------------------------------------------------------- sim engine, whole path


def test_sim_scores_are_deterministic() -> None:
    from lmdq.worker.engines.sim import SimEngine

    eng = SimEngine(step_ms=1)
    try:
        reqs = [EngineRequest(index=0, prompt="Q: 2+2=", endpoint=Endpoint.score, continuations=("4", "five six")),
                EngineRequest(index=1, messages=[*FRANCE, {"role": "assistant", "content": "Paris"}],
                              endpoint=Endpoint.reward),
                EngineRequest(index=2, prompt="hello")]
        a = final_events(eng.stream(reqs, threading.Event()))
        b = final_events(eng.stream(reqs, threading.Event()))
    finally:
        eng.close()
    assert a[0].scores == b[0].scores and a[1].reward == b[1].reward
    assert a[0].scores is not None and [n for _, n, _ in a[0].scores] == [1, 2]
    assert all(lp <= 0 for lp, _, _ in a[0].scores) and a[0].scores[0][0] != a[0].scores[1][0]
    assert a[1].reward is not None and -5 <= a[1].reward < 5
    assert a[2].finish_reason == "length" and a[2].scores is None  # generation is untouched


def test_score_batch_on_sim_through_worker_and_every_export(tmp_path: Path, env: dict[str, str]) -> None:
    """Score and reward lines mixed with a chat line, through submit, a sim worker and the three exports."""
    import pyarrow.parquet as pq

    rows = [
        {"custom_id": "s0", "prompt": "Q: 2+2=", "endpoint": "score", "continuations": ["4", "five", "6 7"]},
        {"custom_id": "g1", "prompt": "hello", "params": {"max_new_tokens": 3}},
        {"custom_id": "r2", "messages": [*FRANCE, {"role": "assistant", "content": "Paris"}], "endpoint": "reward"},
    ]
    f = _jsonl(tmp_path / "mixed.jsonl", rows)
    bid, res = sim_batch_results(f, env, "--model", "sim")
    assert [r.custom_id for r in res] == ["s0", "g1", "r2"]
    assert all(r.status is ResultStatus.completed for r in res)
    s0, g1, r2 = res
    assert s0.endpoint is Endpoint.score and s0.scores is not None and [x.num_tokens for x in s0.scores] == [1, 1, 2]
    assert s0.text == "" and s0.generate_token_len == 0 and s0.reward is None
    assert g1.scores is None and g1.generate_token_len == 3
    assert r2.endpoint is Endpoint.reward and r2.reward is not None and r2.scores is None

    oa = run_cli("producer", "results", bid, "--format", "openai", env=env)
    assert oa.returncode == 0, oa.stderr.decode()
    lines = [json.loads(x) for x in oa.stdout.splitlines()]
    body = lines[0]["response"]["body"]
    from lmdq.results.openai import openai_ids  # issue 45: ids never name the lmdq batch

    assert body["object"] == "list" and body["id"] == "score-" + openai_ids(bid, 0)[0].removeprefix("batch_req_")
    assert [d["score"] for d in body["data"]] == [x.logprob for x in s0.scores]
    assert [d["num_tokens"] for d in body["data"]] == [1, 1, 2]
    assert [d["is_greedy"] for d in body["data"]] == [x.is_greedy for x in s0.scores]
    assert lines[1]["response"]["body"]["object"] == "chat.completion"
    assert lines[2]["response"]["body"]["data"] == [{"index": 0, "object": "score", "score": r2.reward}]

    pq_path = tmp_path / "out.parquet"
    pa_out = run_cli("producer", "results", bid, "-o", str(pq_path), env=env)
    assert pa_out.returncode == 0, pa_out.stderr.decode()
    table = pq.read_table(pq_path).to_pylist()
    assert [t["endpoint"] for t in table] == ["score", "chat", "reward"]
    assert table[0]["scores"] == [x.model_dump() for x in s0.scores]
    assert table[1]["scores"] is None and table[2]["reward"] == r2.reward


# ----------------------------------------------------------------------------- transformers engine (model)


@pytest.fixture(scope="module")
def direct(model_dir: Path) -> Any:
    """An independent transformers model + tokenizer for the direct computation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype="float32").eval()
    return tok, model


_DIRECT_CACHE: dict[str, tuple[float, int, bool]] = {}


def _direct_score(direct: Any, prompt: str | list[dict[str, str]], cont: str) -> tuple[float, int, bool]:
    """Memoised (a CPU forward is slow on a shared box; the tests ask for some pairs twice)."""
    key = json.dumps([prompt, cont])
    if key not in _DIRECT_CACHE:
        _DIRECT_CACHE[key] = direct_score(*direct, prompt, cont)
    return _DIRECT_CACHE[key]


PAIRS_PROMPTS: list[str | list[dict[str, str]]] = [
    "The capital of France is",
    "Question: What is 2 + 2?\nAnswer:",
    "Once upon a time, there was a",
    "The three primary colors are",
    "def add(a, b):\n    return",
    FRANCE,
    [{"role": "user", "content": "Name a fruit."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Translate 'chat' from French."}],
    [{"role": "user", "content": "Is water wet? Answer yes or no."}],
]
PAIRS_CONTS = [" Paris", " London, a city", "The capital of France is Paris.", " 4", " a b c d e f"]


@pytest.mark.model
def test_transformers_scores_equal_direct_log_softmax_on_50_pairs(tf_engine: Any, direct: Any) -> None:
    reqs = []
    for i, prompt in enumerate(PAIRS_PROMPTS):
        kw: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"messages": prompt}
        reqs.append(EngineRequest(index=i, endpoint=Endpoint.score, continuations=tuple(PAIRS_CONTS), **kw))
    finals = final_events(tf_engine.stream(reqs, threading.Event()))
    worst, greedy = 0.0, []
    pairs = 0
    for i, prompt in enumerate(PAIRS_PROMPTS):
        ev = finals[i]
        assert ev.finish_reason == "stop" and ev.scores is not None, ev
        for cont, (lp, n, g) in zip(PAIRS_CONTS, ev.scores, strict=True):
            want_lp, want_n, want_g = _direct_score(direct, prompt, cont)
            assert n == want_n and g == want_g, (prompt, cont)
            worst = max(worst, abs(lp - want_lp))
            greedy.append(g)
            pairs += 1
    assert pairs == 50
    assert worst <= 1e-4, f"largest |engine - direct| sum logprob: {worst:.2e}"
    assert any(greedy) and not all(greedy)  # the flag is exercised both ways
    print(f"\n50 pairs: max |engine - direct| = {worst:.2e}; is_greedy true for {sum(greedy)}")


@pytest.mark.model
def test_transformers_score_errors_fail_alone(tf_engine: Any) -> None:
    long = " word" * (tf_engine.session_len + 5)
    reqs = [EngineRequest(index=0, prompt="Hi", endpoint=Endpoint.score, continuations=(long,)),
            EngineRequest(index=1, messages=[*FRANCE, {"role": "assistant", "content": "Paris"}],
                          endpoint=Endpoint.reward),
            EngineRequest(index=2, prompt="Hi", endpoint=Endpoint.score, continuations=(" there",))]
    finals = final_events(tf_engine.stream(reqs, threading.Event()))
    assert finals[0].error_code == "context_length_exceeded"
    assert finals[1].error_code == "bad_request" and "reward model" in (finals[1].error_message or "")
    assert finals[2].finish_reason == "stop" and finals[2].scores is not None


MC = [  # (question, 4 choices); the answer key is irrelevant: the test checks lmdq picks what the model picks
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"]),
    ("Two plus two equals", [" four", " five", " seven", " ten"]),
    ("The opposite of hot is", [" cold", " warm", " blue", " fast"]),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " meters", " grams"]),
    ("The sun rises in the", [" east", " west", " north", " south"]),
    ("A baby cat is called a", [" kitten", " puppy", " calf", " foal"]),
    ("The largest planet in our solar system is", [" Jupiter", " Mars", " Venus", " Mercury"]),
    ("Bees make", [" honey", " milk", " silk", " wool"]),
]


@pytest.mark.model
def test_multiple_choice_file_end_to_end_picks_what_the_model_picks(
        tf_engine: Any, direct: Any, tmp_path: Path, env: dict[str, str], client: redis.Redis, redis_url: str,
        prefix: str) -> None:
    """submit (the CLI) -> the worker loop (real Redis, the transformers engine) -> results (CLI, lmdq and
    OpenAI lines); the argmax over each question's 4 summed logprobs equals the direct computation's."""
    from lmdq.worker.engines.base import Borrowed
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    rows = [{"custom_id": f"q{i}", "prompt": q, "endpoint": "score", "continuations": choices}
            for i, (q, choices) in enumerate(MC)]
    f = _jsonl(tmp_path / "mc.jsonl", rows)
    p = run_cli("producer", "submit", str(f), "--model", tf_engine.model_name, "--allow-unknown-model",
                "--batch-size", "3", env=env)
    assert p.returncode == 0, p.stderr.decode()
    bid = p.stdout.decode().strip()
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, burst=True, health_port=0)
    Worker(engine=Borrowed(tf_engine), client=client, settings=s).run()
    out = run_cli("producer", "results", bid, "--wait", "--timeout", "60", env=env)
    assert out.returncode == 0, out.stderr.decode()
    res = [Result.model_validate_json(x) for x in out.stdout.splitlines()]
    assert [r.custom_id for r in res] == [f"q{i}" for i in range(len(MC))]
    picks, want = [], []
    for r, (q, choices) in zip(res, MC, strict=True):
        assert r.status is ResultStatus.completed and r.scores is not None and len(r.scores) == 4
        got = [x.logprob for x in r.scores]
        ref = [_direct_score(direct, q, c)[0] for c in choices]
        assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4
        picks.append(got.index(max(got)))
        want.append(ref.index(max(ref)))
    assert picks == want
    oa = run_cli("producer", "results", bid, "--format", "openai", env=env)
    lines = [json.loads(x) for x in oa.stdout.splitlines()]
    oa_picks = [max(range(4), key=lambda k, ln=ln: ln["response"]["body"]["data"][k]["score"]) for ln in lines]
    assert oa_picks == want
    print(f"\nmultiple choice picks: {picks} (direct: {want})")


@pytest.fixture(scope="module")
def reward_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-weight Llama sequence classifier with ONE label, the embedded tokenizer beside it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(cfg).eval()
    out = tmp_path_factory.mktemp("reward")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.model
def test_reward_equals_a_direct_sequence_classification_forward(reward_dir: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lmdq.worker.engines.transformers_engine import TransformersEngine

    chats = [[*FRANCE, {"role": "assistant", "content": a}] for a in ("Paris.", "Berlin.", "I don't know.")]
    chats.append([{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}])
    eng = TransformersEngine(model_path=reward_dir, served_model_name="rm")
    try:
        assert eng.reward_model
        reqs = [EngineRequest(index=i, messages=c, endpoint=Endpoint.reward) for i, c in enumerate(chats)]
        reqs.append(EngineRequest(index=len(chats), prompt="hello"))  # generation on a reward model: refused
        finals = final_events(eng.stream(reqs, threading.Event()))
    finally:
        eng.close()
    tok = AutoTokenizer.from_pretrained(reward_dir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, local_files_only=True).eval()
    rewards = []
    for i, chat in enumerate(chats):
        ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))
        with torch.inference_mode():
            want = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
        assert finals[i].finish_reason == "stop" and finals[i].reward is not None
        assert abs(finals[i].reward - want) <= 1e-5, (finals[i].reward, want)
        assert finals[i].input_token_len == len(ids)
        rewards.append(finals[i].reward)
    assert len(set(rewards)) == len(rewards)  # different chats, different scores: the head is really read
    assert finals[len(chats)].error_code == "bad_request"


def test_python_api_scores_dict_rows_and_a_dataframe(redis_url: str, prefix: str) -> None:
    """``client.submit(rows, endpoint="score", prompt_column=...)`` with a ``continuations`` column, from
    dicts and from a DataFrame (the Arrow path: a list<string> column), read back as Arrow."""
    import pandas as pd

    import lmdq
    from lmdq.submission.settings import ProducerSettings
    from lmdq.worker.engines.sim import SimEngine
    from lmdq.worker.runner import Worker
    from lmdq.worker.settings import WorkerSettings

    api = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    rows = [{"qid": f"q{i}", "question": q, "continuations": c} for i, (q, c) in enumerate(MC[:3])]
    a = api.submit(rows, model="sim", allow_unknown_model=True, endpoint="score", prompt_column="question",
                   id_column="qid")
    b = api.submit(pd.DataFrame(rows), model="sim", allow_unknown_model=True, endpoint="score",
                   prompt_column="question", id_column="qid")
    with pytest.raises(lmdq.SubmitRejected, match="continuations"):
        api.submit([{"question": "Q", "continuations": []}], model="sim", allow_unknown_model=True,
                   endpoint="score", prompt_column="question")
    s = WorkerSettings(redis_url=redis_url, key_prefix=prefix, health_port=0, burst=True)
    assert Worker(engine=SimEngine(model_name="sim", step_ms=0), client=redis.Redis.from_url(redis_url),
                  settings=s).run() == 0
    ra, rb = list(a.results()), list(b.results())
    assert [r.custom_id for r in ra] == ["q0", "q1", "q2"] and all(r.scores and len(r.scores) == 4 for r in ra)
    assert [r.scores for r in ra] == [r.scores for r in rb]  # same rows, same (deterministic) scores
    t = a.to_arrow()
    assert t.column("scores").to_pylist()[0] == [x.model_dump() for x in ra[0].scores or []]


class _PplPipe:
    """A stand-in for LMDeploy 0.18's pipeline, answering ``async_get_logits`` as it does (read from
    lmdeploy/serve/core/async_engine.py: every position's logits ``[len, vocab]`` of each sequence, one
    prefill each) with a real transformers model, run through ``_run(coro=...).result()`` as
    Pipeline.get_reward_score runs it, and tokenizing as its HuggingFaceTokenizer
    (``encode(s, add_bos, add_special_tokens)``) and
    HFChatTemplate (``messages2prompt``: the generation prompt after a user turn) do."""

    def __init__(self, direct: Any, *, prefix_caching: bool = False, fail_on: int | None = None) -> None:
        tok, self.model = direct
        self.calls: list[int] = []
        self.fail_on = fail_on

        def encode(s: str, add_bos: bool = True, add_special_tokens: bool = True) -> list[int]:
            ids = tok.encode(s, add_special_tokens=add_special_tokens)
            return ids[1:] if not add_bos and ids and ids[0] == tok.bos_token_id else ids

        def messages2prompt(messages: list[dict[str, Any]]) -> str:
            return str(tok.apply_chat_template(messages, add_generation_prompt=messages[-1]["role"] != "assistant",
                                               tokenize=False))

        from types import SimpleNamespace

        self.async_engine = SimpleNamespace(tokenizer=SimpleNamespace(encode=encode), arch="LlamaForCausalLM",
                                            chat_template=SimpleNamespace(messages2prompt=messages2prompt),
                                            engine=None, async_get_logits=self.async_get_logits,
                                            hf_cfg=SimpleNamespace(vocab_size=self.model.config.vocab_size))
        self.backend_config = SimpleNamespace(enable_prefix_caching=prefix_caching, max_batch_size=8)
        self.internal_thread = SimpleNamespace(loop=None)

    def _run(self, fn: Any = None, coro: Any = None) -> Any:
        import asyncio
        from concurrent.futures import Future

        fut: Future[Any] = Future()
        try:
            fut.set_result(asyncio.run(coro))
        except Exception as e:  # noqa: BLE001 - handed on as the pipeline's future would
            fut.set_exception(e)
        return fut

    async def async_get_logits(self, input_ids: list[list[int]]) -> list[Any]:
        import torch

        self.calls.append(len(input_ids))
        out = []
        for ids in input_ids:
            if self.fail_on is not None and self.fail_on in ids:
                raise RuntimeError("stand-in: this sequence breaks the engine call")
            with torch.inference_mode():
                out.append(self.model(input_ids=torch.tensor([ids])).logits[0].half())  # fp16, as LMDeploy's
        return out


def _lmdeploy_on(pipe: Any) -> Any:
    from lmdq.worker.engine_config import LMDeployConfig
    from lmdq.worker.engines.lmdeploy_engine import LMDeployEngine

    # LMDeploy's pipeline() needs a GPU: the stand-in goes in through the constructor instead
    return LMDeployEngine(pipe, LMDeployConfig(backend="pytorch"), model_name="m", emit_interval_s=0.0)


@pytest.mark.model
def test_lmdeploy_score_path_from_all_logits_equals_the_transformers_engine(tf_engine: Any, direct: Any) -> None:
    """The LMDeploy engine's arithmetic (the continuation's rows of one forward over prompt + continuation,
    log_softmax in float32) and tokenization, on a stand-in answering async_get_logits with fp16 logits:
    equal to the transformers engine within 1e-2 per token (fp16 logits; 1e-4 is the float32 bar of
    the transformers engine itself), token counts and is_greedy equal, ONE logits call for the group."""
    reqs = []
    for i, prompt in enumerate(PAIRS_PROMPTS[3:7]):  # raw and chat prompts (each get_ppl row is a CPU forward)
        kw: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"messages": prompt}
        reqs.append(EngineRequest(index=i, endpoint=Endpoint.score, continuations=tuple(PAIRS_CONTS), **kw))
    reward = EngineRequest(index=len(reqs), messages=[*FRANCE, {"role": "assistant", "content": "Paris"}],
                           endpoint=Endpoint.reward)
    pipe = _PplPipe(direct)
    got = final_events(_lmdeploy_on(pipe).stream([*reqs, reward], threading.Event()))
    want = final_events(tf_engine.stream(reqs, threading.Event()))
    assert pipe.calls == [len(reqs) * len(PAIRS_CONTS)]  # every (prompt + continuation) at once, no prompt alone
    worst, greedy = 0.0, []
    for r in reqs:
        assert got[r.index].input_token_len == want[r.index].input_token_len
        for (lp, n, g), (wlp, wn, wg) in zip(got[r.index].scores or [], want[r.index].scores or [], strict=True):
            assert n == wn and g == wg and isinstance(g, bool)
            greedy.append(g)
            worst = max(worst, abs(lp - wlp) / n)
    assert worst <= 1e-2, worst
    assert True in greedy and False in greedy  # both answers of is_greedy occur among these pairs
    assert got[reward.index].error_code == "unsupported_feature"  # get_reward_score serves reward archs only

    bad_id = tf_engine._tokenizer.encode(" village", add_special_tokens=False)[0]
    pipe = _PplPipe(direct, fail_on=bad_id)  # one request breaks the call: it alone fails, the rest are asked again
    two = [EngineRequest(index=0, prompt="Hi", endpoint=Endpoint.score, continuations=(" village",)),
           EngineRequest(index=1, prompt="Hi", endpoint=Endpoint.score, continuations=(" there",))]
    got = final_events(_lmdeploy_on(pipe).stream(two, threading.Event()))
    assert got[0].error_code == "internal_error" and got[1].finish_reason == "stop"
    got = final_events(_lmdeploy_on(_PplPipe(direct, prefix_caching=True)).stream(two[1:], threading.Event()))
    assert got[1].error_code == "unsupported_feature" and "prefix caching" in (got[1].error_message or "")
