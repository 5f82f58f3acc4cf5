"""A request's identity: what changes it and what does not; which requests qualify."""

from __future__ import annotations

from lmdq.contract import GenerationParams, Request
from lmdq.reuse.identity import effective_params, identity, inline_inputs, qualifies, request_key, worker_key

W = worker_key(engine="sim", config={"step_ms": 1}, weights="abc")


def ident(req: Request, batch: GenerationParams | None = None, w: bytes = W) -> bytes:
    return identity(w, request_key(effective_params(batch or GenerationParams(), req), req))


def test_custom_id_and_index_are_not_part_of_it_but_the_prompt_is() -> None:
    a = Request(index=0, custom_id="a", prompt="hello")
    assert ident(a) == ident(Request(index=7, custom_id="b", prompt="hello"))
    assert ident(a) != ident(Request(index=0, custom_id="a", prompt="hellp"))
    assert ident(a) != ident(Request(index=0, custom_id="a", prompt="hello", endpoint="completion"))


def test_params_layer_batch_under_request_and_defaults_count_as_set() -> None:
    a = Request(index=0, custom_id="a", prompt="x", params=GenerationParams(max_new_tokens=8))
    b = Request(index=0, custom_id="a", prompt="x")
    assert ident(a) == ident(b, GenerationParams(max_new_tokens=8))
    assert ident(b) == ident(b, GenerationParams(max_new_tokens=512))  # the engine default, spelled out
    assert ident(b) != ident(b, GenerationParams(max_new_tokens=9))
    s1 = GenerationParams(do_sample=True, random_seed=1)
    assert ident(b, s1) != ident(b, GenerationParams(do_sample=True, random_seed=2))


def test_the_worker_key_covers_weights_config_engine_and_adapter() -> None:
    b = Request(index=0, custom_id="a", prompt="x")
    others = [worker_key(engine="sim", config={"step_ms": 1}, weights="abd"),
              worker_key(engine="sim", config={"step_ms": 2}, weights="abc"),
              worker_key(engine="transformers", config={"step_ms": 1}, weights="abc"),
              worker_key(engine="sim", config={"step_ms": 1}, weights="abc", adapter="lora1")]
    assert len({ident(b, w=w) for w in [W, *others]}) == 5


def test_only_inline_images_are_part_of_an_identity() -> None:
    def with_image(url: str) -> Request:
        return Request(index=0, custom_id="a", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]}])

    assert inline_inputs(Request(index=0, custom_id="a", prompt="x"))
    assert inline_inputs(with_image("data:image/png;base64,AAAA"))
    assert not inline_inputs(with_image("/data/cat.png")) and not inline_inputs(with_image("https://x/cat.png"))


def test_only_deterministic_requests_qualify() -> None:
    greedy = GenerationParams().resolved()
    assert qualifies(greedy, repeats_seeds=False)
    unseeded = GenerationParams(do_sample=True).resolved()
    assert not qualifies(unseeded, repeats_seeds=True)
    seeded = GenerationParams(do_sample=True, random_seed=3).resolved()
    assert qualifies(seeded, repeats_seeds=True) and not qualifies(seeded, repeats_seeds=False)
    assert not qualifies(GenerationParams(output_logits="generation").resolved(), repeats_seeds=True)


def test_a_shared_params_key_gives_the_same_identity() -> None:
    from lmdq.reuse.identity import params_key

    r = Request(index=0, custom_id="a", prompt="x")
    p = GenerationParams(max_new_tokens=7).resolved()
    assert request_key(p, r) == request_key(params_key(p), r)
    assert request_key(params_key(p), r) != request_key(params_key(GenerationParams().resolved()), r)


def test_every_request_field_but_index_custom_id_and_params_is_input() -> None:
    a = Request(index=0, custom_id="a", prompt="x", endpoint="score", continuations=["yes"])
    b = Request(index=0, custom_id="a", prompt="x", endpoint="score", continuations=["no"])
    assert ident(a) != ident(b)
    m1 = Request(index=0, custom_id="a", messages=[{"role": "user", "content": "hi"}])
    m2 = Request(index=0, custom_id="a", messages=[{"role": "system", "content": "hi"}])
    assert ident(m1) != ident(m2)
    assert ident(m1) == ident(Request(index=3, custom_id="z", messages=[{"role": "user", "content": "hi"}]))
