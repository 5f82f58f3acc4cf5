"""``lmdq-bench``: throughput benchmarks that print their numbers (never timed unit tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lmdq.cli_options import model_options
from lmdq.errors import run_cli
from lmdq.worker.engine_config import EngineName, SimConfig, engine_flag_specs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  # plain click help, as lmdq-producer: rich cuts long option names at 80 columns
                  rich_markup_mode=None, context_settings={"max_content_width": 120})


@app.command()
@model_options(engine_flag_specs(), into="engine_settings")
def efficiency(
    engine_settings: dict[str, Any],
    engine: Annotated[EngineName, typer.Option(help="the engine, built as the worker builds it")] = "sim",
    model: Annotated[str | None, typer.Option(help="model folder (lmdeploy/transformers)")] = None,
    random_llama8b: Annotated[Path | None, typer.Option(help="build a random Llama-3-8B-shaped model here")] = None,
    tokenizer_from: Annotated[Path | None, typer.Option(help="tokenizer for --random-llama8b")] = None,
    n: Annotated[int, typer.Option(help="prompts")] = 1024,
    batch_size: Annotated[int, typer.Option(help="requests per job (B)")] = 32,
    input_len: Annotated[int, typer.Option()] = 234,
    output_len: Annotated[int, typer.Option()] = 256,
    repeat: Annotated[int, typer.Option(help="repeats of raw/lmdq/naive, median reported")] = 1,
    jobs_in_flight: Annotated[int, typer.Option(help="0 = auto")] = 0,
    skip_naive: Annotated[bool, typer.Option(help="skip the one-job-at-a-time baseline")] = False,
    stream_baseline: Annotated[bool, typer.Option(help="also: all prompts in one engine.stream call (no queue)")
                               ] = False,
    one_at_a_time: Annotated[int | None, typer.Option(
        help="also: this many prompts one request per stream call (the unbatched rate; default 8 for "
             "transformers, else 0)")] = None,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o", help="also write the JSON line here")] = None,
) -> None:
    """raw engine vs lmdq vs naive lmdq, side by side; the LAST line printed is a JSON object.

    The engine is built exactly as the worker builds it (same settings, flags and env vars: --tp,
    --backend, --sim-step-ms, ...); a flag the engine does not take is an error."""
    from lmdq.bench.efficiency import EfficiencyConfig, run_efficiency
    from lmdq.bench.local_redis import local_redis
    from lmdq.worker.engine_factory import build_engine
    from lmdq.worker.settings import load_worker_settings

    cfg = EfficiencyConfig(n=n, batch_size=batch_size, input_len=input_len, output_len=output_len, repeat=repeat,
                           jobs_in_flight=jobs_in_flight, naive=not skip_naive,
                           stream_baseline=stream_baseline,
                           one_at_a_time=min(n, 8 if engine == "transformers" else 0) if one_at_a_time is None
                           else min(n, one_at_a_time))
    model_name = model or ""
    if engine == "lmdeploy":
        if random_llama8b:
            from lmdq.bench.random_model import build_random_llama

            if tokenizer_from is None:
                raise typer.BadParameter("needs --tokenizer-from", param_hint="--random-llama8b")
            model = str(build_random_llama(random_llama8b, tokenizer_from))
            model_name = "random-llama3-8b-shape(vocab=49152)"
        if not model:
            raise typer.BadParameter("--model or --random-llama8b is required", param_hint="--model")
    s = load_worker_settings(engine=engine, model=model, served_model_name="sim-bench" if engine == "sim" else "bench",
                             **engine_settings)
    if engine == "sim":
        knobs = f"step={s.sim.step_ms}ms,max_batch={s.sim.max_batch}"
        if s.sim.emit_every != SimConfig().emit_every or s.sim.step_cpu_ms:
            knobs += f",emit_every={s.sim.emit_every},step_cpu={s.sim.step_cpu_ms}ms"
        model_name = f"sim({knobs})"
    eng = build_engine(s)
    if engine == "transformers":
        model_name = str(getattr(eng, "model_path", model_name))
    with local_redis(redis_url) as url:
        res = run_efficiency(eng, cfg, redis_url=url, log=lambda m: print(m, file=sys.stderr, flush=True))
    eng.close()
    out = {"engine": engine, "model": model_name, "tp": s.lmdeploy.tp, "n": n, "batch_size": batch_size,
           "input_len": input_len, "output_len": output_len,
           **({"mp_engine": s.lmdeploy.mp_engine} if engine == "lmdeploy" else {}), **res}
    print(f"{'path':14s} {'tok/s':>10s} {'vs raw':>7s}")
    for k in ("raw", "stream1", "lmdq", "naive", "one"):
        if res.get(k + "_tok_s") is None:
            continue
        name = "one-at-a-time" if k == "one" else k
        print(f"{name:14s} {res[k + '_tok_s']:>10,.0f} {res[k + '_tok_s'] / res['raw_tok_s']:>7.3f}")
    if res.get("lmdq_vs_one"):
        print(f"lmdq / one-at-a-time: {res['lmdq_vs_one']:.2f}x")
    keep = ["engine", "model", "n", "batch_size", "raw_tok_s", "lmdq_tok_s", "naive_tok_s", "ratio"]
    keep += ["one_tok_s", "lmdq_vs_one"] if res.get("one_tok_s") else []
    line = json.dumps({k: out[k] for k in keep} | {"detail": out})
    if output:
        output.write_text(line + "\n")
    print(line)


@app.command()
def producer(
    lines: Annotated[int, typer.Option(help="lines in the generated JSONL")] = 100_000,
    batch_size: Annotated[int, typer.Option()] = 32,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o")] = None,
) -> None:
    """Submit a generated JSONL and export its results: requests/s both ways, peak RSS, Redis bytes/result."""
    from lmdq.bench.local_redis import local_redis
    from lmdq.bench.producer_bench import run_producer_bench

    with local_redis(redis_url) as url:
        res = run_producer_bench(lines=lines, batch_size=batch_size, redis_url=url,
                                 log=lambda m: print(m, file=sys.stderr, flush=True))
    line = json.dumps(res)
    if output:
        output.write_text(line + "\n")
    print(line)


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
