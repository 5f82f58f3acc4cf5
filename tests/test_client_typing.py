"""lmdq's Python API as a type checker sees it (issue 43): every submit option is a typed keyword
(``Unpack[SubmitKwargs]``, generated from the options' one declaration in src/lmdq/client/options.py), so
a misspelt option or a value of the wrong type is a mypy error in the CALLER's code; the public calls
return what docs/python-api.md says, never Any; SubmitRejected carries its problems as data."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_type_hints

import pytest

import lmdq
from lmdq.client.options import SUBMIT_KWARGS_PATH, option_names, render_submit_kwargs, resolve
from lmdq.client.submit_kwargs import SubmitKwargs
from lmdq.errors import InputProblem, SubmitRejected
from lmdq.submission.settings import ProducerSettings
from tests.conftest import ROOT


def test_the_typed_dict_is_generated_from_the_declarations_and_is_current() -> None:
    assert SUBMIT_KWARGS_PATH.read_text() == render_submit_kwargs(), (
        "src/lmdq/client/submit_kwargs.py is stale: run `python -m lmdq.client.options`")


def test_the_typed_dict_keys_are_exactly_the_options_submit_accepts_at_run_time() -> None:
    keys = set(get_type_hints(SubmitKwargs))
    assert keys == set(SubmitKwargs.__optional_keys__) == option_names()
    # 38 options (issue 46: deadline, canary, gate, gate_window; 47: reuse, reuse_ttl; 48: webhook)
    assert len(keys) == 38 + 3
    settings = ProducerSettings()
    for name in keys:  # each one is accepted by the run-time check (None: unset)
        resolve({name: None}, settings, model="m")
    with pytest.raises(TypeError, match="max_new_token"):
        resolve({"max_new_token": 5}, settings, model="m")


CALLER = '''\
from __future__ import annotations

import lmdq
from collections.abc import Hashable

from lmdq.contract import RequestCounts
from lmdq.errors import InputProblem

client = lmdq.Client("redis://localhost:6379/0")
rows = ["What is 2+2?", "Name a prime."]
client.submit(rows, model="m", max_new_token=5)  # ERROR misspelt
client.submit(rows, model="m", max_new_tokens="5")  # ERROR wrong type
client.submit(rows, model="m", priority="urgent")  # ERROR not a priority
batch: lmdq.Batch = client.submit(rows, model="m", max_new_tokens=5, temperature=0.7, top_p=0.9,
                                  stop_words=["\\\\n"], priority="high", metadata={"run": "nightly"},
                                  result_ttl="7d", completion_window=3600, json_schema={"type": "object"},
                                  prefix_groups=False, response_format=None)
df_batch = client.submit([{"q": "x", "id": 1}], model="m", prompt_column="q", id_column="id")
info: lmdq.BatchInfo = batch.wait(timeout=60)
by_model: dict[str, RequestCounts] = batch.counts_by_model()
for r in batch.as_completed():
    text: str | None = r.text
for chunk in batch.stream(timeout=60):
    delta: str = chunk.text
    done: lmdq.Result | None = chunk.result
names = [m.name for m in client.models()[0]]
gone: bool = client.remove_model("m").registered
deleted = batch.purge()
try:
    client.submit("eval.parquet", model="m", prompt_column="question")
except lmdq.SubmitRejected as e:
    row: int | None = e.row
    label: Hashable | None = e.index
    column: str | None = e.column
    field: str | None = e.field
    first: InputProblem = e.problems[0]
    message: str = e.message
reveal_type(client.batch("b"))
reveal_type(client.batches())
reveal_type(batch.info())
reveal_type(batch.retry())
reveal_type(deleted)
reveal_type(client.redis)
reveal_type(next(batch.stream()))
'''


@pytest.fixture(scope="module")
def mypy_on_caller(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[str]]:
    """The .venv's mypy, --strict, on a caller's script. lmdq is found through ``mypy_path`` = src/ (the
    editable install is a setuptools import hook mypy does not follow); ``follow_imports = silent``
    type-checks against lmdq's annotations without reporting lmdq's own modules, as for an installed
    package."""
    d = tmp_path_factory.mktemp("caller")
    (d / "caller.py").write_text(CALLER)
    (d / "mypy.ini").write_text(textwrap.dedent(f"""\
        [mypy]
        strict = True
        mypy_path = {ROOT / "src"}
        follow_imports = silent
        cache_dir = {d / ".mypy_cache"}
        """))
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    p = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(d / "mypy.ini"), "--no-error-summary",
                        "--show-error-codes", str(d / "caller.py")], cwd=d, env=env, capture_output=True,
                       text=True, timeout=600)
    return p.returncode, [ln.split("caller.py:", 1)[1] for ln in p.stdout.splitlines() if "caller.py:" in ln]


def _line(marker: str) -> int:
    return next(i for i, ln in enumerate(CALLER.splitlines(), 1) if marker in ln)


def test_mypy_refuses_a_misspelt_option_and_a_wrong_type_in_the_callers_code(
        mypy_on_caller: tuple[int, list[str]]) -> None:
    rc, out = mypy_on_caller
    assert rc == 1, out
    errors = [ln for ln in out if ": error:" in ln]
    by_line = {int(ln.split(":", 1)[0]): ln for ln in errors}
    assert set(by_line) == {_line("# ERROR misspelt"), _line("# ERROR wrong type"), _line("# ERROR not a")}, errors
    assert 'Unexpected keyword argument "max_new_token"' in by_line[_line("# ERROR misspelt")]
    assert '"max_new_tokens"' in by_line[_line("# ERROR wrong type")] and '"str"' in by_line[_line("# ERROR wrong")]
    assert '"priority"' in by_line[_line("# ERROR not a")]


def test_the_public_calls_return_their_documented_types(mypy_on_caller: tuple[int, list[str]]) -> None:
    _, out = mypy_on_caller
    revealed = [ln.split('Revealed type is "', 1)[1].rstrip('"') for ln in out if "Revealed type is" in ln]
    assert revealed == [
        "lmdq.client.client.Batch",
        "list[lmdq.client.client.Batch]",
        "lmdq.contract.Batch",
        "lmdq.client.client.Batch",
        "lmdq.submission.ledger.Purged",
        "redis.client.Redis",
        "lmdq.client.stream.StreamChunk",
    ], out
    assert not [r for r in revealed if "Any" in r]


def test_submit_rejected_carries_its_problems_as_data() -> None:
    e = SubmitRejected("DataFrame: row 4: column 'temperature': expected a number from 0.0 to 2.0, got 9.0\n"
                       "prompts.jsonl:3: field 'prompt': expected a non-empty string\n"
                       "batch b1 was cancelled while it was being staged")
    assert (e.row, e.column, e.source, e.line) == (4, "temperature", "DataFrame", None)
    assert e.problems[1] == InputProblem(message="expected a non-empty string", source="prompts.jsonl", line=3,
                                         field="prompt")
    assert e.problems[2] == InputProblem(message="batch b1 was cancelled while it was being staged")
    assert e.message == str(e)



def test_a_problem_read_back_from_its_text_keeps_the_count_its_text_said() -> None:
    """Issue 45: each row's text says its count; read back, ``row`` is the 0-based position whatever the text
    said, and a DataFrame's label is ``index`` (its Python value where it is a literal)."""
    e = SubmitRejected("q.csv: row 4 (1-based): column 'q': expected some text\n"
                       "rows: row 3 (0-based): column 'q': expected some text\n"
                       "DataFrame: index 'a7': column 'q': expected some text\n"
                       "DataFrame: index 42: expected a dict\n"
                       "q.jsonl:4: field 'prompt': expected a non-empty string")
    assert [(p.source, p.row, p.index, p.line, p.column) for p in e.problems] == [
        ("q.csv", 3, None, None, "q"), ("rows", 3, None, None, "q"), ("DataFrame", None, "a7", None, "q"),
        ("DataFrame", None, 42, None, None), ("q.jsonl", None, None, 4, None)]
    assert (e.row, e.index, e.source) == (3, None, "q.csv")


def test_a_bad_option_is_named_with_its_value(redis_url: str, prefix: str) -> None:
    client = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    with pytest.raises(SubmitRejected) as bad:
        client.submit(["x"], model="m", allow_unknown_model=True, result_ttl=5)
    assert (bad.value.field, bad.value.value, bad.value.row) == ("result_ttl", 5, None)
    assert str(bad.value) == "result_ttl: expected at least 60 seconds, got 5"
    with pytest.raises(SubmitRejected) as bad:
        client.submit(["x"], model="m", allow_unknown_model=True, temperature=9.0)
    assert (bad.value.field, bad.value.value) == ("temperature", 9.0)
    assert str(bad.value).startswith("temperature: ")


def test_bad_rows_are_named_by_row_column_and_value(redis_url: str, prefix: str) -> None:
    client = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    rows = [{"q": "fine", "t": 0.5}, {"q": "", "t": 0.5}, {"q": "hot", "t": 9.0}, {"q": "dup", "id": "a"}]
    with pytest.raises(SubmitRejected) as bad:
        client.submit(rows, model="m", allow_unknown_model=True, prompt_column="q",
                      params_columns={"t": "temperature"})
    e = bad.value
    assert [(p.row, p.column, p.value) for p in e.problems] == [(1, "q", ""), (2, "t", 9.0)], e.problems
    assert (e.row, e.column, e.value, e.source) == (1, "q", "", "rows")
    ids = [{"q": "a", "id": "x"}, {"q": "b", "id": "y"}, {"q": "c", "id": "x"}]
    with pytest.raises(SubmitRejected) as bad:
        client.submit(ids, model="m", allow_unknown_model=True, prompt_column="q", id_column="id")
    assert (bad.value.row, bad.value.column, bad.value.value) == (2, "id", "x")
    assert bad.value.message \
        == "rows: row 2 (0-based): column 'id': expected a unique id, 'x' already used on row 0 (0-based)"


def test_the_package_ships_its_types() -> None:
    assert (Path(lmdq.__file__).parent / "py.typed").is_file()


def test_invalid_argument_names_the_argument(redis_url: str, prefix: str) -> None:
    client = lmdq.Client(redis_url, settings=ProducerSettings(redis_url=redis_url, key_prefix=prefix))
    with pytest.raises(lmdq.InvalidArgument) as bad:
        client.submit(["x"])
    assert (bad.value.field, bad.value.value) == ("model", None) and isinstance(bad.value, ValueError)
    with pytest.raises(lmdq.InvalidArgument) as bad:
        client.register_models(["ok", "bad name"])
    assert (bad.value.field, bad.value.value) == ("names", "bad name")
