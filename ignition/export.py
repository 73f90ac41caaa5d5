"""`ignition export`: checkpoint -> prepared core, as one deterministic pipeline.

open source -> map architecture and tensors -> resolve recipe (sampling) -> probe template ->
plan graphs -> write atomically. Every failure a user can cause is an ExportError.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
from tokenizers import Tokenizer

import ignition
from helios.core import layout
from helios.core.kimi_encoding import CONTROL_TOKENS as KIMI_CONTROL_TOKENS
from helios.core.kimi_encoding import KIND as KIMI_KIND
from helios.core.manifest import (
    FORMAT_VERSION,
    MAX_TOP_LOGPROBS_LIMIT,
    Limits,
    LogprobCaps,
    Manifest,
    ModelIdentity,
    TokenizerInfo,
    Vision,
)
from ignition import archs, recipes
from ignition.errors import ExportError
from ignition.prepare.kernels import add_kernels, resolve_target
from ignition.prepare.plan import graph_plan
from ignition.prepare.template import probe, probe_native
from ignition.sources import Checkpoint, open_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_TOKENS = 2048


class ExportOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    recipe: str | None = None
    dtype: str = "auto"  # auto: float32 for CPU targets, bfloat16 for CUDA targets
    target: str = "cpu"  # cpu | cuda-sm90 | ... | auto (cuda-sm<cc> of the visible GPU, else cpu)
    prompt_logprobs: bool = False
    max_top_logprobs: int = MAX_TOP_LOGPROBS_LIMIT
    sampling_ranges: bool = True
    aliases: list[str] = []
    context_length: int | None = None
    default_max_tokens: int | None = None


def resolve_dtype(dtype: str, target: str) -> str:
    if dtype == "auto":
        return "bfloat16" if target.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype '{dtype}' (choose auto, {', '.join(DTYPES)})")
    return dtype


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_info(ckpt: Checkpoint, tok: Tokenizer) -> TokenizerInfo:
    cfg = ckpt.tokenizer_config

    def tid(key: str) -> int | None:
        text = _token_str(cfg.get(key))
        return tok.token_to_id(text) if text is not None else None

    bos, eos, pad, unk = tid("bos_token"), tid("eos_token"), tid("pad_token"), tid("unk_token")
    eos_ids: list[int] = [eos] if eos is not None else []
    for source in (ckpt.generation_config, ckpt.config):
        extra = source.get("eos_token_id")
        for i in extra if isinstance(extra, list) else [extra] if extra is not None else []:
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
    if bos is None and isinstance(ckpt.config.get("bos_token_id"), int):
        bos = ckpt.config["bos_token_id"]
    return TokenizerInfo(
        file=layout.TOKENIZER_FILE,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        unk_token_id=unk,
        add_bos_token=bool(cfg.get("add_bos_token", False)),
        add_eos_token=bool(cfg.get("add_eos_token", False)),
    )


# Recipes whose prompts DeepSeek's own encoder renders, and the native template kind each names.
NATIVE_TEMPLATES = {"deepseek4": "deepseek_v4", "deepseek41": "deepseek_v41"}
# The tool parser of each native kind: the DSML spelling its encoder teaches (helios/output/parsers/dsml.py), or
# XTML for Kimi K3. It replaces the recipe's (V3.2 `dsml`, or none): the prompt teaches these tags whatever the
# recipe names. Kimi K3's channels need their own reasoning parser as well (helios/output/parsers/xtml.py).
NATIVE_TOOL_PARSERS = {"deepseek_v4": "dsml_v4", "deepseek_v41": "dsml_v41", KIMI_KIND: "xtml"}
NATIVE_REASONING_PARSERS = {KIMI_KIND: "xtml"}


def native_template_kind(family: str, recipe: str, chat_template: str | None) -> str | None:
    """The native encoder a deepseek_v4 checkpoint's prompts use: DeepSeek ships its chat format as a Python
    script, so a checkpoint without a Jinja template, or one bound to a DeepSeek recipe, gets helios' encoder of it
    (V4.1 under deepseek41). None: the Jinja template (or none), as for every other family."""
    if family != "deepseek_v4":
        return None
    if recipe in NATIVE_TEMPLATES:
        return NATIVE_TEMPLATES[recipe]
    return "deepseek_v4" if not chat_template else None


def kimi_template_kind(tok: Tokenizer, chat_template: str | None) -> str | None:
    """Kimi K3's native encoder for a checkpoint without a Jinja template whose tokenizer holds XTML's control
    tokens (<|open|>, <|close|>, <|sep|>, <|end_of_msg|>): K3 ships its chat format as a Python script and no K3
    family exists to key on. None otherwise (a Jinja template wins)."""
    if chat_template or any(tok.token_to_id(t) is None for t in KIMI_CONTROL_TOKENS):
        return None
    return KIMI_KIND


def source_digest(files: list[Path]) -> str:
    """Content digest of the source: file names relative to their common root, and bytes."""
    h = hashlib.sha256()
    root = Path(*Path(files[0]).parts[:-1]) if files else Path(".")
    for f in sorted(files):
        rel = Path(f).name if len(files) == 1 else Path(f).relative_to(root).as_posix()
        h.update(rel.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def export_core(
    source: str | Path,
    out: Path,
    options: ExportOptions = ExportOptions(),
    on_tensor: Callable[[str, int], None] | None = None,
    force: bool = False,
) -> Path:
    """Export `source` into a core at `out`. on_tensor(name, total) is called per written tensor."""
    if not 0 <= options.max_top_logprobs <= MAX_TOP_LOGPROBS_LIMIT:
        raise ExportError(f"--max-top-logprobs must be within 0..{MAX_TOP_LOGPROBS_LIMIT}")
    target = resolve_target(options.target)
    dtype_name = resolve_dtype(options.dtype, target)
    ckpt = open_source(source)
    arch, tensors = archs.convert(ckpt, DTYPES[dtype_name])
    tensors = list(tensors)
    tok = Tokenizer.from_str(ckpt.tokenizer_json)
    tokenizer = tokenizer_info(ckpt, tok)
    recipe_name = options.recipe or recipes.auto_recipe(arch.family, ckpt.identifier)
    recipe, sampling = recipes.resolve(recipe_name, ckpt.generation_config, options.sampling_ranges)
    specials = {
        key: _token_str(ckpt.tokenizer_config.get(key))
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    native = native_template_kind(arch.family, recipe_name, ckpt.chat_template) or kimi_template_kind(
        tok, ckpt.chat_template)
    if native is not None:
        template = probe_native(native, ckpt.tokenizer_json)
        recipe = msgspec.structs.replace(recipe, tool_parser=NATIVE_TOOL_PARSERS[native],
                                         reasoning_parser=NATIVE_REASONING_PARSERS.get(native, recipe.reasoning_parser))
    else:
        template = probe(ckpt.chat_template, ckpt.tokenizer_json, specials)
    if template.present and template.kind == "jinja":
        template = msgspec.structs.replace(template, file=layout.TEMPLATE_FILE)
    context = min(arch.max_position_embeddings, options.context_length or arch.max_position_embeddings)
    default_max = min(options.default_max_tokens or DEFAULT_MAX_TOKENS, context)
    aliases = [a for a in options.aliases if a]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        ignition_version=ignition.__version__,
        model=ModelIdentity(
            id=ckpt.identifier,
            name=ckpt.identifier.rsplit("/", 1)[-1],
            aliases=aliases,
            source_sha256=source_digest(ckpt.source_files),
        ),
        arch=arch,
        recipe=recipe,
        dtype=dtype_name,
        tokenizer=tokenizer,
        template=template,
        sampling=sampling,
        logprobs=LogprobCaps(
            max_top_logprobs=options.max_top_logprobs,
            explicit_token_ids=True,
            prompt_logprobs=options.prompt_logprobs,
        ),
        vision=Vision(),
        limits=Limits(context_length=context, default_max_tokens=default_max),
        graph_plan=graph_plan(target, options.max_top_logprobs, context),
        decode_weight_bytes=archs.decode_weight_bytes(arch, DTYPES[dtype_name]),
    )
    from ignition.write import write_core

    total = len(tensors)
    path = write_core(
        Path(out),
        manifest,
        tensors,
        ckpt.tokenizer_json,
        ckpt.chat_template if template.file else None,
        DTYPES[dtype_name],
        on_tensor=(lambda name: on_tensor(name, total)) if on_tensor else None,
        force=force,
    )
    if target.startswith("cuda"):
        try:
            add_kernels(path, target)
        except ExportError as exc:
            # NOTE: kernels are optional (helios compiles on first use); a core without them still serves.
            warnings.warn(f"{exc}; the core has no precompiled kernels", stacklevel=2)
    return path
