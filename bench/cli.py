"""``lmdq-bench``: throughput benchmarks that print their numbers (never timed unit tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lmdq.cli.options import model_options
from lmdq.cli.run import run_cli
from lmdq.worker.engine_settings import engine_flag_specs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  # plain click help, as lmdq-producer: rich cuts long option names at 80 columns
                  rich_markup_mode=None, context_settings={"max_content_width": 120})


def _emit(res: dict[str, Any], output: Path | None) -> None:
    """The last line every bench prints: its JSON object, also written to ``-o`` when given."""
    line = json.dumps(res)
    if output:
        output.write_text(line + "\n")
    print(line)


def _resolve_model(engine: str, model: str | None, random_llama8b: Path | None, tokenizer_from: Path | None
                   ) -> tuple[str | None, str]:
    """(model folder, name for the report); builds the random Llama-3-8B shape when asked."""
    from lmdq.worker.engines.registry import engine_spec

    model_name = model or ""
    if engine_spec(engine).bench.needs_model:
        if random_llama8b:
            from lmdq_bench.random_model import build_random_llama

            if tokenizer_from is None:
                raise typer.BadParameter("needs --tokenizer-from", param_hint="--random-llama8b")
            model = str(build_random_llama(random_llama8b, tokenizer_from))
            model_name = "random-llama3-8b-shape(vocab=49152)"
        if not model:
            raise typer.BadParameter("--model or --random-llama8b is required", param_hint="--model")
    return model, model_name


def _build_engine(engine: str, model: str | None, random_llama8b: Path | None, tokenizer_from: Path | None,
                  engine_settings: dict[str, Any]) -> tuple[Any, Any, str]:
    """(engine, worker settings, model name for the report), the engine built exactly as the worker builds it."""
    from lmdq.worker.engine_factory import build_engine
    from lmdq.worker.engines.registry import engine_spec
    from lmdq.worker.settings import load_worker_settings

    model, model_name = _resolve_model(engine, model, random_llama8b, tokenizer_from)
    s = load_worker_settings(engine=engine, model=model, served_model_name="sim-bench" if engine == "sim" else "bench",
                             **engine_settings)
    eng = build_engine(s)
    return eng, s, engine_spec(engine).bench.label(s.engine_config, eng, model_name)


@app.command()
@model_options(engine_flag_specs(), into="engine_settings")
def efficiency(
    engine_settings: dict[str, Any],
    engine: Annotated[str, typer.Option(help="the engine, built as the worker builds it")] = "sim",
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
    from lmdq_bench.efficiency import EfficiencyConfig, run_efficiency
    from lmdq_bench.local_redis import local_redis

    cfg = EfficiencyConfig(n=n, batch_size=batch_size, input_len=input_len, output_len=output_len, repeat=repeat,
                           jobs_in_flight=jobs_in_flight, naive=not skip_naive,
                           stream_baseline=stream_baseline,
                           one_at_a_time=min(n, 8 if engine == "transformers" else 0) if one_at_a_time is None
                           else min(n, one_at_a_time))
    eng, s, model_name = _build_engine(engine, model, random_llama8b, tokenizer_from, engine_settings)
    with local_redis(redis_url) as url:
        res = run_efficiency(eng, cfg, redis_url=url, log=lambda m: print(m, file=sys.stderr, flush=True))
    eng.close()
    out = {"engine": engine, "model": model_name, "tp": getattr(s.engine_config, "tp", 1), "n": n,
           "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
           **({"mp_engine": s.engine_config.mp_engine} if engine == "lmdeploy" else {}), **res}
    print(f"{'path':14s} {'tok/s':>10s} {'vs raw':>7s}")
    for k in ("raw", "stream1", "lmdq", "naive", "one"):
        if res.get(k + "_tok_s") is None:
            continue
        name = "one-at-a-time" if k == "one" else k
        print(f"{name:14s} {res[k + '_tok_s']:>10,.0f} {res[k + '_tok_s'] / res['raw_tok_s']:>7.3f}")
        if k == "lmdq":  # the second clock: from the submit's start, parse and staging included
            print(f"{'  from submit':14s} {res['lmdq_from_submit_tok_s']:>10,.0f} {res['ratio_from_submit']:>7.3f}")
    if res.get("lmdq_vs_one"):
        print(f"lmdq / one-at-a-time: {res['lmdq_vs_one']:.2f}x")
    keep = ["engine", "model", "n", "batch_size", "raw_tok_s", "lmdq_tok_s", "naive_tok_s", "ratio",
            "lmdq_from_submit_tok_s", "ratio_from_submit"]
    keep += ["one_tok_s", "lmdq_vs_one"] if res.get("one_tok_s") else []
    _emit({k: out[k] for k in keep} | {"detail": out}, output)


@app.command()
@model_options(engine_flag_specs(), into="engine_settings")
def prefix(
    engine_settings: dict[str, Any],
    engine: Annotated[str, typer.Option(help="the engine, built as the worker builds it")] = "sim",
    model: Annotated[str | None, typer.Option(help="model folder (lmdeploy/transformers)")] = None,
    random_llama8b: Annotated[Path | None, typer.Option(help="build a random Llama-3-8B-shaped model here")] = None,
    tokenizer_from: Annotated[Path | None, typer.Option(help="tokenizer for --random-llama8b")] = None,
    docs: Annotated[int, typer.Option(help="documents (D)")] = 200,
    doc_tokens: Annotated[int, typer.Option(help="tokens per document (T), by the engine's tokenizer")] = 2000,
    questions: Annotated[int, typer.Option(help="questions per document (Q)")] = 8,
    output_len: Annotated[int, typer.Option(help="tokens generated per question")] = 64,
    batch_size: Annotated[int, typer.Option(help="requests per job (B)")] = 32,
    cache_docs: Annotated[float | None, typer.Option(help="documents the KV cache holds; default 10 %% of --docs "
                                                     "(sets --num-gpu-blocks / --sim-prefix-cache-tokens)")] = None,
    jobs_in_flight: Annotated[int, typer.Option(help="0 = auto")] = 0,
    seed: Annotated[int, typer.Option()] = 0,
    workload: Annotated[Path | None, typer.Option(help="write the JSONL here (default: a temp folder)")] = None,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    workers: Annotated[int, typer.Option(help="N > 1: N lmdq workers vs N raw processes on 1/N of the file "
                                         "each, one device each (lmdq_bench.prefix_fleet)")] = 1,
    output: Annotated[Path | None, typer.Option("-o", help="also write the JSON line here")] = None,
) -> None:
    """Shuffled document-QA: raw pipe(prompts) vs lmdq (prefix groups, one worker), prefix caching on
    for both; the LAST line printed is a JSON object.

    Unless given: lmdeploy runs --backend pytorch --enable-prefix-caching with --num-gpu-blocks for
    --cache-docs documents and --session-len for one request; sim gets --sim-prefix-cache-tokens for
    --cache-docs documents and --sim-prefill-us-per-token 25 (about an 8B model's prefill on an H200)."""
    import tempfile

    from lmdq_bench.local_redis import local_redis
    from lmdq_bench.prefix import KV_BLOCK_TOKENS, PrefixConfig, kv_blocks, run_prefix

    cfg = PrefixConfig(docs=docs, doc_tokens=doc_tokens, questions=questions, output_len=output_len,
                       batch_size=batch_size, cache_docs=cache_docs, jobs_in_flight=jobs_in_flight, seed=seed)
    blocks = kv_blocks(cfg)
    settings = dict(engine_settings)
    if engine == "lmdeploy":
        settings.setdefault("backend", "pytorch")
        settings.setdefault("enable_prefix_caching", True)
        settings.setdefault("session_len", doc_tokens + output_len + 256)
        if "cache_max_entry_count" not in settings:
            if settings["backend"] == "pytorch":
                settings.setdefault("num_gpu_blocks", blocks)
            else:  # TurboMind: a count above 1 is blocks
                settings["cache_max_entry_count"] = float(blocks)
    elif engine == "sim":
        settings.setdefault("sim_prefix_cache_tokens", blocks * KV_BLOCK_TOKENS)
        settings.setdefault("sim_prefill_us_per_token", 25.0)
    if workers > 1:
        _prefix_fleet(cfg, workers, engine, model, random_llama8b, tokenizer_from, settings, workload, redis_url,
                      output)
        return
    eng, s, model_name = _build_engine(engine, model, random_llama8b, tokenizer_from, settings)
    with tempfile.TemporaryDirectory() as d, local_redis(redis_url) as url:
        path = workload or Path(d) / "prefix_workload.jsonl"
        res = run_prefix(eng, cfg, workload=path, redis_url=url, log=lambda m: print(m, file=sys.stderr, flush=True))
    eng.close()
    kv = {k: v for k, v in settings.items() if k in ("backend", "enable_prefix_caching", "num_gpu_blocks",
                                                     "cache_max_entry_count", "session_len",
                                                     "sim_prefix_cache_tokens", "sim_prefill_us_per_token")}
    out = {"engine": engine, "model": model_name, "docs": docs, "doc_tokens": doc_tokens, "questions": questions,
           "n": cfg.n, "output_len": output_len, "batch_size": batch_size, "cache_docs": cfg.cached_docs,
           "kv_blocks": blocks, "engine_settings": kv, **res}
    print(f"{'path':6s} {'tok/s':>10s} {'vs raw':>7s} {'prefilled':>11s}")
    for k in ("raw", "lmdq"):
        run = res["runs"][k]
        pre = f"{run['prefilled_tokens']:>11,d}" if "prefilled_tokens" in run else f"{'n/a':>11s}"
        print(f"{k:6s} {run['tok_s']:>10,.0f} {run['tok_s'] / res['raw_tok_s']:>7.3f} {pre}")
    _emit({k: out[k] for k in ("engine", "model", "n", "raw_tok_s", "lmdq_tok_s", "ratio")} | {"detail": out}, output)


@app.command()
@model_options(engine_flag_specs(), into="engine_settings")
def samples(
    engine_settings: dict[str, Any],
    engine: Annotated[str, typer.Option(help="the engine, built as the worker builds it")] = "sim",
    model: Annotated[str | None, typer.Option(help="model folder (lmdeploy/transformers)")] = None,
    random_llama8b: Annotated[Path | None, typer.Option(help="build a random Llama-3-8B-shaped model here")] = None,
    tokenizer_from: Annotated[Path | None, typer.Option(help="tokenizer for --random-llama8b")] = None,
    prompts: Annotated[int, typer.Option(help="prompts (P)")] = 1024,
    n: Annotated[int, typer.Option(min=2, max=128, help="samples per prompt")] = 8,
    input_len: Annotated[int, typer.Option(help="prompt tokens")] = 234,
    output_len: Annotated[int, typer.Option(help="tokens generated per sample (ignore_eos)")] = 128,
    batch_size: Annotated[int, typer.Option(help="n-sample requests per job (the lines side: n x as many)")] = 32,
    temperature: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    jobs_in_flight: Annotated[int, typer.Option(help="0 = auto")] = 0,
    raw_baseline: Annotated[bool, typer.Option(help="also the same requests in one engine call, no queue")] = False,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o", help="also write the JSON line here")] = None,
) -> None:
    """P prompts x n samples (params.n) vs the same P x n requests one per line: out tok/s and prefilled
    tokens side by side (lmdq_bench.samples); the LAST line printed is a JSON object.

    Unless given: lmdeploy runs --enable-prefix-caching (what shares the prefill there); sim gets
    --sim-prefix-cache-tokens for every prompt and --sim-prefill-us-per-token 25."""
    from lmdq_bench.local_redis import local_redis
    from lmdq_bench.samples import SamplesConfig, run_samples

    cfg = SamplesConfig(prompts=prompts, n=n, input_len=input_len, output_len=output_len, batch_size=batch_size,
                        temperature=temperature, seed=seed, jobs_in_flight=jobs_in_flight, raw_baseline=raw_baseline)
    settings = dict(engine_settings)
    if engine == "lmdeploy":
        settings.setdefault("enable_prefix_caching", True)
    elif engine == "sim":
        settings.setdefault("sim_prefix_cache_tokens", prompts * (input_len + 16))
        settings.setdefault("sim_prefill_us_per_token", 25.0)
    eng, s, model_name = _build_engine(engine, model, random_llama8b, tokenizer_from, settings)
    with local_redis(redis_url) as url:
        res = run_samples(eng, cfg, redis_url=url, log=lambda m: print(m, file=sys.stderr, flush=True))
    eng.close()
    out = {"engine": engine, "model": model_name, "prompts": prompts, "samples_per_prompt": n,
           "input_len": input_len, "output_len": output_len, "batch_size": batch_size, "engine_settings": settings,
           **res}
    print(f"{'side':6s} {'requests':>9s} {'tok/s':>10s} {'vs lines':>9s} {'prefilled':>11s} {'unshared':>11s}")
    for k in [k for k in ("n", "lines", "raw") if k in res["runs"]]:
        run = res["runs"][k]
        pre = f"{run['prefilled_tokens']:>11,d}" if "prefilled_tokens" in run else f"{'n/a':>11s}"
        unshared = f"{run['prompt_tokens_unshared']:>11,d}" if "prompt_tokens_unshared" in run else f"{'':>11s}"
        print(f"{k:6s} {run['requests']:>9,d} {run['tok_s']:>10,.0f} {run['tok_s'] / res['lines_tok_s']:>9.3f} "
              f"{pre} {unshared}")
    keep = ["engine", "model", "prompts", "samples_per_prompt", "n_tok_s", "lines_tok_s", "raw_tok_s", "tok_s_ratio",
            "n_prefilled", "lines_prefilled", "prefill_saving_vs_unshared", "prefill_saving_vs_lines"]
    _emit({k: out.get(k) for k in keep} | {"detail": out}, output)


def _prefix_fleet(cfg: Any, workers: int, engine: str, model: str | None, random_llama8b: Path | None,
                  tokenizer_from: Path | None, settings: dict[str, Any], workload: Path | None, redis_url: str | None,
                  output: Path | None) -> None:
    """``prefix --workers N``: the engines live in child processes (one per device), so this process only
    sizes the documents with the model's tokenizer and writes the workload."""
    import tempfile

    from lmdq_bench.local_redis import local_redis
    from lmdq_bench.prefix import make_workload
    from lmdq_bench.prefix_fleet import run_split_and_fleet

    model, model_name = _resolve_model(engine, model, random_llama8b, tokenizer_from)
    if engine == "lmdeploy":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))

        class _Counter:
            def count_tokens(self, text: str) -> int:
                return len(tok.encode(text, add_special_tokens=False))

        counter: Any = _Counter()
    else:
        counter, _, _ = _build_engine(engine, model, random_llama8b, tokenizer_from, settings)
    env = {"LMDQ_ENGINE": engine, **({"LMDQ_MODEL": str(model)} if model else {})}
    env |= {f"LMDQ_{k.upper()}": (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in settings.items()}
    with tempfile.TemporaryDirectory() as d, local_redis(redis_url) as url:
        path = workload or Path(d) / "prefix_workload.jsonl"
        make_workload(counter, cfg, path)
        res = run_split_and_fleet(cfg, workers=workers, engine=engine, env=env, workload=path, redis_url=url,
                                  log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{'path':12s} {'tok/s':>10s} {'vs split':>9s}")
    print(f"{'split x' + str(workers):12s} {res['split_tok_s']:>10,.0f} {1.0:>9.3f}")
    print(f"{'lmdq x' + str(workers):12s} {res['lmdq_tok_s']:>10,.0f} {res['ratio']:>9.3f}")
    out = {"engine": engine, "model": model_name or engine, "n": cfg.n, "docs": cfg.docs, "questions": cfg.questions,
           "doc_tokens": cfg.doc_tokens, "output_len": cfg.output_len, "batch_size": cfg.batch_size,
           "engine_settings": settings, **res}
    _emit({k: out[k] for k in ("engine", "model", "n", "workers", "split_tok_s", "lmdq_tok_s", "ratio")}
          | {"detail": out}, output)


def _require_fixed_kv(engine_settings: dict[str, Any]) -> None:
    """``--interleave`` loads every engine at once, and a fractional ``cache_max_entry_count`` is a share of
    the memory free *when each engine allocates*: the second engine gets a share of what the first left, so
    the two sides would decode with different running batches (session 16: lmdq "0.58x raw" on the mixed
    workload, all of it from fewer KV blocks). Only a block count gives every side the same cache, and only
    the PyTorch backend takes one: TurboMind in LMDeploy 0.18 aborts the process on a ``cache_max_entry_count``
    of 1 or more ("object-cache path no longer accepts cache_max_block_count as a block count", H200, session
    17), so a TurboMind comparison runs its sides one after the other, each alone on the GPU."""
    backend = engine_settings.get("backend", "auto")
    if backend == "pytorch" and int(engine_settings.get("num_gpu_blocks") or 0) > 0:
        return
    if backend == "pytorch":
        want = "give each the same block count with --num-gpu-blocks N"
    else:
        want = ("TurboMind takes no block count (LMDeploy 0.18 aborts on --cache-max-entry-count >= 1): run the "
                "sides one after the other, without --interleave, or use --backend pytorch --num-gpu-blocks N")
    raise typer.BadParameter(
        f"--interleave loads every engine on one GPU at once, and a KV cache given as a fraction of free "
        f"memory differs between them (each takes its share of what the others left): {want}",
        param_hint="--interleave")


@app.command()
@model_options(engine_flag_specs(), into="engine_settings")
def e2e(
    engine_settings: dict[str, Any],
    engine: Annotated[str, typer.Option(help="lmdeploy (the benchmark) or sim (a CPU check of the bench)")
                      ] = "lmdeploy",
    model: Annotated[str | None, typer.Option(help="model folder")] = None,
    random_llama8b: Annotated[Path | None, typer.Option(help="build a random Llama-3-8B-shaped model here")] = None,
    tokenizer_from: Annotated[Path | None, typer.Option(help="tokenizer for --random-llama8b")] = None,
    workload: Annotated[str, typer.Option(help="mixed (completion, ignore_eos) | chat (real chat, stops at EOS) | "
                                               "image (a question about one image each: a VLM)")
                        ] = "mixed",
    n: Annotated[int, typer.Option(help="prompts per batch")] = 1024,
    batches: Annotated[int, typer.Option(min=1, help="batches a side (the first reported apart)")] = 3,
    batch_size: Annotated[int, typer.Option(help="requests per job (submit --batch-size)")] = 32,
    min_input: Annotated[int, typer.Option(help="mixed: shortest prompt, tokens")] = 32,
    max_input: Annotated[int, typer.Option(help="mixed: longest prompt, tokens")] = 512,
    min_output: Annotated[int, typer.Option(help="mixed: fewest new tokens")] = 16,
    max_output: Annotated[int, typer.Option(help="mixed: most new tokens")] = 1024,
    chat_max_new_tokens: Annotated[int, typer.Option(help="chat: max_new_tokens of every request")] = 384,
    raw_warmup: Annotated[bool, typer.Option(help="run the worker's warm-up on the raw side too")] = True,
    workdir: Annotated[Path | None, typer.Option(help="keep the workload, the logs and raw.json here")] = None,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o", help="also write the JSON line here")] = None,
    lmdq_variant: Annotated[list[str] | None, typer.Option(
        help="NAME or NAME:K=V,K=V (repeatable): one lmdq side per variant against the one raw side, its worker "
             "started with those LMDQ_* settings (e.g. whole:STREAM_FROM_NEW_TOKENS=100000); the bench's own key "
             "SUBMIT=cli|python (never passed to the worker) picks the side's submit door: an lmdq-producer "
             "submit process per batch (cli, the default) or lmdq.Client.submit in this process (python), e.g. "
             "--lmdq-variant cli --lmdq-variant api:SUBMIT=python")] = None,
    py_spy: Annotated[str | None, typer.Option(help="py-spy binary: record each worker during --profile-batch")
                      ] = None,
    profile_batch: Annotated[int, typer.Option(help="which batch --py-spy records (0 = the first)")] = 1,
    interleave: Annotated[bool, typer.Option(
        help="load the raw process and every worker at once, then alternate their batches (raw first on even "
             "batches, last on odd ones), so GPU drift hits both sides; the engines share the GPU, so each "
             "needs the same fixed KV cache: --num-gpu-blocks (PyTorch) or --cache-max-entry-count above 1 "
             "(TurboMind: blocks)")] = False,
) -> None:
    """Real CLIs (an lmdq-worker process, an lmdq-producer submit process per batch) vs a raw pipe() process
    on the same prompts; the LAST line printed is a JSON object (lmdq_bench.e2e)."""
    from lmdq_bench.e2e import E2EConfig, parse_variant, run_e2e
    from lmdq_bench.local_redis import local_redis

    if interleave and engine == "lmdeploy":  # before a model is built or an engine started
        _require_fixed_kv(engine_settings)
    model_path, model_name = _resolve_model(engine, model, random_llama8b, tokenizer_from)
    model_path = model_path or engine
    try:
        variants = tuple(parse_variant(v) for v in lmdq_variant or ())
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--lmdq-variant") from None
    if interleave and any(v.name == "raw" for v in variants):
        raise typer.BadParameter("with --interleave no variant may be named 'raw' (the raw side's name)",
                                 param_hint="--lmdq-variant")
    cfg = E2EConfig(engine=engine, workload=workload, n=n, batches=batches, batch_size=batch_size, min_input=min_input,
                    max_input=max_input, min_output=min_output, max_output=max_output,
                    chat_max_new_tokens=chat_max_new_tokens, raw_warmup=raw_warmup, variants=variants, py_spy=py_spy,
                    profile_batch=profile_batch, interleave=interleave)
    with local_redis(redis_url) as url:
        res = run_e2e(cfg, model=model_path, engine_settings=engine_settings, redis_url=url, work=workdir,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    res = {"model": model_name or model_path, "engine_settings": engine_settings, **res}
    order = res.get("order")  # --interleave: which side ran first in each batch, a column of its own
    print(f"{'batch':>6s} {'raw tok/s':>10s} {'lmdq tok/s':>11s} {'lmdq/raw':>9s}" + ("  first" if order else ""))
    for b, (r, q) in enumerate(zip(res["raw"]["batches"], res["lmdq"]["batches"])):
        print(f"{b:>6d} {r['tok_s']:>10,.0f} {q['tok_s']:>11,.0f} {q['tok_s'] / r['tok_s']:>9.3f}"
              + (f"  {order[b][0][:20]}" if order else ""))
    for name, v in res["variants"].items():
        later = f"{v['ratio_later']:.3f}" if v.get("ratio_later") else "n/a"
        print(f"lmdq[{name}]: first batch {v['ratio_first']:.3f}, later batches {later}, all {v['ratio_all']:.3f} "
              f"(per batch {', '.join(f'{x:.3f}' for x in v['ratio_per_batch'])}); start to ready: raw "
              f"{res['raw']['ready_s']} s, lmdq {v['lmdq']['ready_s']} s; submit door: {v['submit']}")
        print(f"lmdq[{name}] from its first visible job (the queue's own clock): first batch "
              f"{v['ratio_first_from_visible']:.3f}, all {v['ratio_all_from_visible']:.3f}")
    keep = ["model", "workload", "n", "batches", "submit", "ratio_first", "ratio_later", "ratio_all",
            "ratio_first_from_visible", "ratio_all_from_visible", "raw_first_tok_s", "lmdq_first_tok_s",
            "raw_later_tok_s", "lmdq_later_tok_s"]
    if interleave:
        keep.append("interleave")
    # every lmdq side's door and ratios (the top-level keys above are the first side's)
    sides = {name: {k: v.get(k) for k in ("submit", "ratio_first", "ratio_later", "ratio_all",
                                          "ratio_first_from_visible", "ratio_all_from_visible")}
             | {"first_visible_s": [b["first_visible_s"] for b in v["lmdq"]["batches"]]}
             for name, v in res["variants"].items()}
    _emit({k: res.get(k) for k in keep} | {"sides": sides, "detail": res}, output)


@app.command()
def producer(
    lines: Annotated[int, typer.Option(help="lines in the generated JSONL")] = 100_000,
    batch_size: Annotated[int, typer.Option()] = 32,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o")] = None,
    tabular_rows: Annotated[int, typer.Option(help="rows of the 3-column Parquet file submitted beside the same "
                                                   "rows as JSONL, then exported to Parquet (0: skip)")] = 0,
    rounds: Annotated[int, typer.Option(min=1, help="alternated submits of each with --tabular-rows; the best of "
                                                    "each is reported")] = 2,
) -> None:
    """Submit a generated JSONL and export its results: requests/s both ways, peak RSS, Redis bytes/result;
    with --tabular-rows, Parquet vs JSONL submit side by side and results -o out.parquet."""
    from lmdq_bench.local_redis import local_redis
    from lmdq_bench.producer_bench import run_producer_bench, run_tabular_bench

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    with local_redis(redis_url) as url:
        res = run_producer_bench(lines=lines, batch_size=batch_size, redis_url=url, log=say) if lines else {}
        if tabular_rows:
            res["tabular"] = run_tabular_bench(rows=tabular_rows, batch_size=batch_size, redis_url=url, log=say,
                                               rounds=rounds)
    _emit(res, output)


@app.command()
def export(
    n: Annotated[int, typer.Option(help="results in the batch")] = 100_000,
    record_bytes: Annotated[int, typer.Option(help="bytes of each result record (about)")] = 4096,
    per_job: Annotated[int, typer.Option(help="results per shard (job)")] = 1000,
    in_redis: Annotated[bool, typer.Option(help="results in the batch's Redis hash instead of sealed shards "
                                                "(n x record bytes of Redis memory: keep n small)")] = False,
    jsonl: Annotated[bool, typer.Option(help="also time results -o out.jsonl")] = True,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o")] = None,
) -> None:
    """Peak RSS of ``lmdq-producer results -o out.parquet`` for N results of ~4 KB (issue 49: under 300 MB at
    1,000,000); the LAST line is JSON."""
    from lmdq_bench.export_memory import run_export_bench
    from lmdq_bench.local_redis import local_redis

    with local_redis(redis_url) as url:
        res = run_export_bench(n=n, record_bytes=record_bytes, per_job=per_job, in_redis=in_redis, jsonl=jsonl,
                               redis_url=url, log=lambda m: print(m, file=sys.stderr, flush=True))
    _emit(res, output)


@app.command()
def fleet(
    workers: Annotated[int, typer.Option(help="sim worker processes in the fleet run")] = 2,
    capacity: Annotated[int, typer.Option(help="engine slots per worker (--sim-max-batch)")] = 2048,
    batch_size: Annotated[int, typer.Option(help="requests per job")] = 32,
    rounds: Annotated[int, typer.Option(help="engine-fulls of requests per worker in each batch")] = 4,
    input_len: Annotated[int, typer.Option(help="prompt words")] = 64,
    output_len: Annotated[int, typer.Option(help="tokens generated per request")] = 64,
    decode_step_ms: Annotated[float, typer.Option(help="the sim workers' --sim-step-ms")] = 50.0,
    idle_workers: Annotated[int, typer.Option(help="idle workers (threads) whose Redis cost is measured")] = 100,
    poll_workers: Annotated[int, typer.Option(help="idle workers polling (LMDQ_IDLE_WAIT_S=0), to compare")] = 5,
    idle_window: Annotated[float, typer.Option(help="seconds each idle cost is measured over")] = 20.0,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server (recommended: "
                                                  "its counters then hold this bench alone)")] = None,
    output: Annotated[Path | None, typer.Option("-o", help="also write the JSON line here")] = None,
) -> None:
    """N sim worker processes on one Redis: req/s and efficiency vs N x one worker, Redis CPU and
    commands per request, memory per queued/running/completed request, idle workers' cost. The LAST
    line printed is a JSON object."""
    from lmdq.logs.config import configure_logging
    from lmdq_bench.fleet import FleetConfig, run_fleet, table
    from lmdq_bench.local_redis import local_redis

    configure_logging("json", "WARNING")  # the idle workers run in this process: keep stdout for results
    cfg = FleetConfig(workers=workers, capacity=capacity, batch_size=batch_size, rounds=rounds, input_len=input_len,
                      output_len=output_len, decode_step_ms=decode_step_ms, idle_workers=idle_workers,
                      poll_workers=poll_workers, idle_window_s=idle_window)
    with local_redis(redis_url) as url:
        res = run_fleet(cfg, redis_url=url, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(res))
    _emit(res, output)


@app.command("plan")
def plan_cmd(
    requests: Annotated[int, typer.Option(help="lines of the planned file")] = 10_000,
    history: Annotated[int, typer.Option(help="requests the fleet runs first (the model's history)")] = 2_000,
    workers: Annotated[int, typer.Option(help="sim worker processes")] = 2,
    capacity: Annotated[int, typer.Option(help="engine slots per worker (--sim-max-batch)")] = 128,
    batch_size: Annotated[int, typer.Option(help="requests per job")] = 32,
    step_ms: Annotated[float, typer.Option(help="the sim workers' --sim-step-ms")] = 4.0,
    prefill_us: Annotated[float, typer.Option(help="the sim workers' --sim-prefill-us-per-token")] = 20.0,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o", help="also write the JSON line here")] = None,
) -> None:
    """A plan's predicted GPU-seconds and input tokens against the measured sim run that follows (issue 46).
    The LAST line printed is a JSON object."""
    from lmdq.logs.config import configure_logging
    from lmdq_bench.local_redis import local_redis
    from lmdq_bench.plan_bench import PlanBenchConfig, run_plan_bench, table

    configure_logging("json", "WARNING")
    cfg = PlanBenchConfig(requests=requests, history=history, workers=workers, capacity=capacity,
                          batch_size=batch_size, step_ms=step_ms, prefill_us=prefill_us)
    with local_redis(redis_url) as url:
        res = run_plan_bench(cfg, redis_url=url, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(res))
    _emit(res, output)


@app.command()
def sink(
    n: Annotated[int, typer.Option(help="requests in the batch")] = 100_000,
    batch_size: Annotated[int, typer.Option(help="requests per job")] = 32,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per answer (sim engine)")] = 16,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server (used_memory is "
                                                       "server-wide: give only a private one)")] = None,
    output: Annotated[Path | None, typer.Option("-o")] = None,
) -> None:
    """Redis bytes per completed request with and without a results sink; the LAST line is JSON."""
    from lmdq_bench.local_redis import local_redis
    from lmdq_bench.sink_memory import run_sink_bench

    with local_redis(redis_url) as url:
        res = run_sink_bench(n=n, batch_size=batch_size, tokens=max_new_tokens, redis_url=url,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{'':10s} {'used_memory':>12s} {'MEMORY USAGE':>13s} {'export':>10s}")
    print(f"{'':10s} {'B/request':>12s} {'B/request':>13s} {'req/s':>10s}")
    for name in ("with_sink", "without"):
        r = res[name]
        print(f"{name:10s} {r['used_memory_delta_b_per_request']:>12,.1f} {r['memory_usage_b_per_request']:>13,.1f} "
              f"{r['export_req_s']:>10,}")
    _emit(res, output)


@app.command()
def reuse(
    n: Annotated[int, typer.Option(help="requests in the batch (run twice)")] = 1_000_000,
    batch_size: Annotated[int, typer.Option(help="requests per job")] = 1000,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per answer (sim engine decode steps)")] = 256,
    step_ms: Annotated[float, typer.Option(help="sim engine: ms per decode step")] = 5.0,
    max_batch: Annotated[int, typer.Option(help="sim engine: sequences decoded at once")] = 256,
    index_n: Annotated[int, typer.Option(help="also: fill an index of this many entries through the worker's "
                                              "record call and weigh it (bytes per entry at that size; 0: no)")
                       ] = 1_000_000,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o")] = None,
) -> None:
    """A --reuse batch run twice on the sim engine with a folder sink: the second run's speed-up, that nothing
    reached the engine, identical answers, and the reuse index's Redis bytes per entry; the LAST line is JSON."""
    from lmdq_bench.local_redis import local_redis
    from lmdq_bench.reuse import run_reuse_bench

    with local_redis(redis_url) as url:
        res = run_reuse_bench(n=n, batch_size=batch_size, tokens=max_new_tokens, redis_url=url,
                              sim={"step_ms": step_ms, "max_batch": max_batch}, index_n=index_n,
                              log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"first run {res['first']['run_s']:,.1f} s, second run {res['second']['run_s']:,.1f} s: "
          f"{res['speedup_run']}x faster ({res['second']['engine_steps']} engine steps, identical answers: "
          f"{res['identical_answers']}, reused_from on {res['reused_from_set']:,} of {res['n']:,})")
    print(f"reuse index: {res['index_entries']:,} entries, {res['index_bytes']:,} bytes, "
          f"{res['index_bytes_per_entry']} B/entry")
    if res["index_fill"]:
        f = res["index_fill"]
        print(f"reuse index filled to {f['entries']:,} entries: {f['bytes']:,} bytes, {f['bytes_per_entry']} B/entry")
    _emit(res, output)


@app.command()
def exporter(
    batches: Annotated[int, typer.Option(help="batch records in Redis")] = 10_000,
    scrapes: Annotated[int, typer.Option(help="concurrent scrapes each way")] = 200,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server (commands are "
                                                       "counted server-wide: give only a private one)")] = None,
    output: Annotated[Path | None, typer.Option("-o")] = None,
) -> None:
    """Concurrent /metrics scrapes, Redis read at each scrape vs the exporter's snapshot, side by side;
    the LAST line is JSON."""
    from lmdq_bench.exporter_bench import run_exporter_bench, table
    from lmdq_bench.local_redis import local_redis

    with local_redis(redis_url) as url:
        res = run_exporter_bench(url, batches=batches, scrapes=scrapes,
                                 log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(res))
    _emit(res, output)


@app.command()
def api(
    upload_mb: Annotated[int, typer.Option(help="size of the uploaded file, MB")] = 200,
    clients: Annotated[int, typer.Option(help="concurrent SDK clients polling batches.retrieve")] = 50,
    polls: Annotated[int, typer.Option(help="retrieve calls per client")] = 40,
    redis_url: Annotated[str | None, typer.Option(help="use this Redis instead of starting one")] = None,
    submit: Annotated[bool, typer.Option(help="also submit the uploaded file as a batch (validation + enqueue "
                                              "in the server) and report its time and the peak RSS after")] = False,
) -> None:
    """lmdq-api under load: a large upload's peak server memory, many SDK clients polling one batch
    (lmdq_bench.api_bench); the LAST line is JSON."""
    from lmdq_bench.api_bench import report, run

    report(run(upload_mb, clients, polls, redis_url, submit), clients=clients, polls=polls, submit=submit)


@app.command("cli-startup")
def cli_startup(
    runs: Annotated[int, typer.Option(min=1, help="children per case (the median is reported)")] = 7,
    python: Annotated[str | None, typer.Option(help="the interpreter to measure (default: this one); another "
                                                    "checkout's .venv/bin/python measures that checkout")] = None,
    redis_url: Annotated[str | None, typer.Option(help="default: start a local redis-server")] = None,
    output: Annotated[Path | None, typer.Option("-o")] = None,
) -> None:
    """Import milliseconds of ``lmdq-producer --help``, ``status --help`` and ``status BATCH`` (python -X
    importtime, median of RUNS children; issue 49's bar: under 150 ms); the LAST line is JSON."""
    from lmdq_bench.cli_startup import run_cli_startup
    from lmdq_bench.local_redis import local_redis

    with local_redis(redis_url) as url:
        res = run_cli_startup(redis_url=url, python=python, runs=runs,
                              log=lambda m: print(m, file=sys.stderr, flush=True))
    _emit(res, output)


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
