"""lmdq.images.parts: which content parts are images, and what a well-formed one is."""

from __future__ import annotations

from lmdq.contract import ChatMessage
from lmdq.images.parts import image_urls, part_problem, placeholder_text

IMG = {"type": "image_url", "image_url": {"url": "a.png", "detail": "low"}}


def test_well_formed_parts_have_no_problem() -> None:
    assert part_problem({"type": "text", "text": "hi"}) is None
    assert part_problem(IMG) is None


def test_each_malformed_part_names_its_sub_field() -> None:
    assert part_problem("x") == ("", "expected a content part object {'type': 'text' | 'image_url', ...}")
    assert part_problem({"type": "text", "text": 3}) == (".text", "expected a string")
    assert part_problem({"type": "image_url", "image_url": "a.png"})[0] == ".image_url"  # type: ignore[index]
    assert part_problem({"type": "image_url"})[0] == ".image_url"  # type: ignore[index]
    assert part_problem({"type": "image_url", "image_url": {"url": ""}})[0] == ".image_url.url"  # type: ignore[index]
    assert part_problem({"type": "input_audio"}) == (".type", "expected 'text' or 'image_url'")


def test_image_urls_in_order_from_dicts_and_models() -> None:
    msgs = [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "q"}, IMG, {"type": "image_url", "image_url": {}}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "b.png"}}]}]
    assert list(image_urls(msgs)) == [(1, 1, "a.png"), (2, 0, "b.png")]
    assert list(image_urls([ChatMessage.model_validate(m) for m in msgs[::2]])) == [(1, 0, "b.png")]


def test_placeholder_text_never_holds_the_bytes() -> None:
    assert placeholder_text([{"type": "text", "text": "see "}, IMG]) == "see <image>"
    assert placeholder_text("plain") == "plain" and placeholder_text(None) == ""


def test_the_contract_accepts_image_parts_and_a_text_model_refuses_them() -> None:
    m = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "q"}, IMG]})
    m.check_parts()
    assert m.image_urls() == ["a.png"]
    try:
        m.text()
    except ValueError as e:
        assert "vision-language" in str(e)
    else:
        raise AssertionError("text() flattened an image part away")
