"""The LMDeploy engine's warm-up requests (worker/engines/lmdeploy_engine.py ``warmup_requests``), on CPU:
on a vision-language model a quarter carry a real JPEG as a ``data:`` URL in the form the worker hands
images over; on a text model none does. (The warm-up itself runs on the GPU: tests/gpu/.)"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from lmdq.contract import Endpoint
from lmdq.images.parts import image_urls
from lmdq.worker.engines.lmdeploy_engine import WARMUP_IMAGE_SIDES, warmup_requests


def _image_urls(messages: list[dict[str, object]] | None) -> list[str]:
    return [url for _i, _j, url in image_urls(messages or [])]


def test_a_text_model_warms_up_on_text_only() -> None:
    reqs = warmup_requests(32, 4096, vision=False)
    assert len(reqs) == 32 and [r.index for r in reqs] == list(range(32))
    assert not any(_image_urls(r.messages) for r in reqs)
    assert {r.endpoint for r in reqs} == {Endpoint.chat, Endpoint.completion}


@pytest.mark.parametrize("n", [4, 32])
def test_a_vision_model_warms_up_on_real_images_of_several_sizes_too(n: int) -> None:
    reqs = warmup_requests(n, 4096, vision=True)
    pictured = [r for r in reqs if _image_urls(r.messages)]
    assert len(pictured) == n // 4 and all(r.endpoint is Endpoint.chat for r in pictured)
    sides = set()
    for r in pictured:
        (url,) = _image_urls(r.messages)
        assert url.startswith("data:image/jpeg;base64,")
        img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        img.load()  # a real, decodable JPEG
        assert img.format == "JPEG" and img.width == img.height
        sides.add(img.width)
    assert sides == set(WARMUP_IMAGE_SIDES[: len(sides)]) and len(sides) == min(len(pictured), len(WARMUP_IMAGE_SIDES))
    # the text warm-up is unchanged around them: the other requests are the text model's
    text = warmup_requests(n, 4096, vision=False)
    assert [(r.prompt, r.messages) for r in reqs if not _image_urls(r.messages)] == [
        (r.prompt, r.messages) for i, r in enumerate(text) if i % 4 != 3]
