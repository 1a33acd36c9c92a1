"""ms-swift external plugin for the conformance check's random-weight Qwen-VL models with the embedded tokenizer.

ms-swift's Qwen2-VL/Qwen3-VL templates find the image and video placeholders by Qwen's own token ids (class
attributes ``image_token_id = 151655``, ``video_token_id = 151656``), which the embedded tokenizer does not use: the
template then leaves one placeholder per image instead of one per visual token and the model refuses the batch
("Image features and image tokens do not match"). Loaded next to our summary plugin (``--external_plugins``), this
points those attributes at the ids of the tokenizer in ``RM_SWIFT_TOKENIZER_DIR``. Real Qwen checkpoints never need it.
"""

from __future__ import annotations

import os

from swift.template.templates.qwen import Qwen2VLTemplate
from transformers import AutoTokenizer

_tok = AutoTokenizer.from_pretrained(os.environ["RM_SWIFT_TOKENIZER_DIR"])
Qwen2VLTemplate.image_token_id = _tok.convert_tokens_to_ids("<|image_pad|>")
Qwen2VLTemplate.video_token_id = _tok.convert_tokens_to_ids("<|video_pad|>")
