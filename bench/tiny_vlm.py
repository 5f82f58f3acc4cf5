"""A tiny LLaVA-style vision-language model built locally from a config, random weights (issue 48).

No download: the tokenizer is borrowed from a local model folder (the embedded SmolLM2's, by default),
with an ``<image>`` token added; the vision tower is a 2-layer CLIP over 28x28 pixels in 14x14 patches
(4 image tokens), the language model a 2-layer Llama. Text is gibberish; what tests and benchmarks need
is that images go through the whole path: submit, the job, the worker's read, the processor's pixels, the
vision tower, the answer. ``width`` / ``depth`` / ``image_size`` make a bigger one for the GPU bench
(LMDeploy's PyTorch engine serves ``LlavaForConditionalGeneration``).

``python -m lmdq_bench.tiny_vlm OUT [--tokenizer-from DIR]`` builds one from the command line.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "build_tiny_vlm"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image>\n{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML (SmolLM2's) with each image part as ``<image>``: the processor expands it to the image's tokens."""


def build_tiny_vlm(dst: Path, tokenizer_from: Path | None = None, *, width: int = 64, depth: int = 2,
                   image_size: int = 28, patch: int = 14, weights: str = "float32", seed: int = 0) -> Path:
    """Build the model folder at ``dst`` (kept if it is already complete) and return it."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    dst = Path(dst)
    if (dst / "lmdq-tiny-vlm.json").exists():
        return dst
    if tokenizer_from is None:
        from lmdq.worker.default_model import ensure_default_model

        tokenizer_from = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from), local_files_only=True)
    # A pad token of its own, as every llava-hf checkpoint has ("<pad>"): LMDeploy's PyTorch engine marks a
    # prompt's image positions with the model's pad_token_id and finds them again by that id, so a pad shared
    # with a token the chat template writes (SmolLM2 pads with <|im_end|>) makes every image request's step
    # fail a CUDA size check (found on the H200, session 22).
    tok.add_special_tokens({"additional_special_tokens": ["<image>"], "pad_token": "<pad>"})
    image_token_id = tok.convert_tokens_to_ids("<image>")
    text = LlamaConfig(vocab_size=len(tok), hidden_size=width, intermediate_size=width * 2,
                       num_hidden_layers=depth, num_attention_heads=max(1, width // 64),
                       num_key_value_heads=max(1, width // 64), max_position_embeddings=2048,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       tie_word_embeddings=False,
                       # LMDeploy builds the language model from text_config alone and picks its class by
                       # architectures, which transformers 5 no longer fills in for a nested config
                       architectures=["LlamaForCausalLM"])
    vision = CLIPVisionConfig(hidden_size=width, intermediate_size=width * 2, num_hidden_layers=depth,
                              num_attention_heads=max(1, width // 64), image_size=image_size, patch_size=patch,
                              projection_dim=width)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                      vision_feature_layer=-1, vision_feature_select_strategy="full",
                      projector_hidden_act="gelu")
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(getattr(torch, weights))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    _legacy_vision_keys(tmp)
    improc = CLIPImageProcessor(size={"shortest_edge": image_size},
                                crop_size={"height": image_size, "width": image_size}, do_center_crop=True,
                                do_resize=True)
    tok.chat_template = CHAT_TEMPLATE
    processor = LlavaProcessor(image_processor=improc, tokenizer=tok, patch_size=patch,
                               vision_feature_select_strategy="full", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "lmdq-tiny-vlm.json").write_text(json.dumps({"width": width, "depth": depth, "image_size": image_size,
                                                         "patch": patch, "seed": seed}))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def _legacy_vision_keys(folder: Path) -> None:
    """transformers 5 saves the CLIP tower as ``vision_tower.embeddings...``; LMDeploy's LLaVA (and every llava-hf
    checkpoint) names it ``vision_tower.vision_model.embeddings...``. transformers loads either, so the files are
    written the way both read them."""
    from safetensors.torch import load_file, save_file

    def legacy(key: str) -> str:
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            return "vision_tower.vision_model." + key[len("vision_tower."):]
        return key

    for f in sorted(folder.glob("*.safetensors")):
        sd = load_file(str(f))
        renamed = {legacy(k): v for k, v in sd.items()}
        if renamed.keys() != sd.keys():
            save_file(renamed, str(f), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, default=None)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=28)
    ap.add_argument("--weights", default="float32", help="the weights dtype (float32, bfloat16)")
    a = ap.parse_args(argv)
    print(build_tiny_vlm(a.out, a.tokenizer_from, width=a.width, depth=a.depth, image_size=a.image_size,
                         weights=a.weights))


if __name__ == "__main__":
    main()
