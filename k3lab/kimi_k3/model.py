"""Kimi-K3 as the pipeline sees it: one ``Model`` object bundling the config schema, the rule table,
the transforms, the checkpoint layout, llama.cpp's ``kimi-k3`` keys, the tokenizer and the vision
mmproj. The front passes ``MODEL`` to the pipeline, which imports nothing from here."""

from __future__ import annotations

from k3lab.formats.safetensors import INDEX_NAME
from k3lab.kimi_k3.calibration import CALIBRATION
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.guide import GUIDE
from k3lab.kimi_k3.keys import ARCH, file_kvs, tokenizer_kvs
from k3lab.kimi_k3.layout import check_formats, unit_layout
from k3lab.kimi_k3.mmproj import MMPROJ
from k3lab.kimi_k3.rules import RULES, TEXT_PREFIX, config_tags, layer_of, unit_tags
from k3lab.kimi_k3.runtime import context_bytes
from k3lab.kimi_k3.transforms import TRANSFORMS
from k3lab.pipeline.model import Model

# the metadata files a conversion is planned from (their bytes are part of the plan's digest); a
# checkpoint saved whole (one model.safetensors) has no index
META_FILES = ("config.json", "tiktoken.model", "tokenizer_config.json")
OPTIONAL_META = (INDEX_NAME, "chat_template.jinja", "preprocessor_config.json")

MODEL = Model(
    name=ARCH,
    module=__name__,
    default_basename="Kimi-K3",
    text_prefix=TEXT_PREFIX,
    meta_files=META_FILES,
    optional_meta=OPTIONAL_META,
    rules=RULES,
    transforms=TRANSFORMS,
    load_config=K3Config.load,
    config_from_dict=K3Config.from_dict,
    unit_of=layer_of,
    unit_tags=unit_tags,
    config_tags=config_tags,
    layout=unit_layout,
    file_kvs=file_kvs,
    tokenizer_kvs=tokenizer_kvs,
    single=MMPROJ,
    other_prefixes=MMPROJ.prefixes,
    guide=GUIDE,
    check_source=check_formats,
    calibration=CALIBRATION,
    context_bytes=context_bytes,
)
