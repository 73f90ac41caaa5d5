"""Read a Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) into a Checkpoint.

Owns the directory layout and safetensors validation; tensors stay on disk until LazyTensor.load.
Reads no model hub and never imports transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON_FILE = "chat_template.json"  # older processor layout: {"chat_template": "..."}
GENERATION_CONFIG_FILE = "generation_config.json"

# safetensors dtype code -> (torch dtype label, bytes per element)
_ST_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def looks_like_hub_id(text: str) -> bool:
    """`org/name` with hub-legal characters: one slash, no leading '.', '/' or '~', no '..'."""
    return bool(_HUB_ID.match(text)) and ".." not in text


def open_hf_dir(path: Path) -> Checkpoint:
    """Open an HF checkpoint directory lazily; every defect of the input is an ExportError naming the file.

    identifier rule: config.json's `_name_or_path` when it looks like a hub id (`org/name`, see
    `looks_like_hub_id`; local paths such as "/tmp/x" or "./x" do not), otherwise the directory's name.
    """
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: not a directory")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ExportError(f"{path}: no config.json")
    config = _read_json(config_path)
    weight_files, tensors = _open_weights(path)
    tokenizer_path = path / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise ExportError(f"{path}: no tokenizer.json (ignition needs the HF tokenizers file)")
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    try:
        json.loads(tokenizer_json)
    except ValueError as e:
        raise ExportError(f"{tokenizer_path}: not valid JSON ({e})") from None

    files = [config_path, tokenizer_path, *weight_files]
    tokenizer_config: dict = {}
    tc_path = path / TOKENIZER_CONFIG_FILE
    if tc_path.is_file():
        tokenizer_config = _read_json(tc_path)
        files.append(tc_path)
    chat_template, template_files = _chat_template(path, tokenizer_config)
    files += template_files
    generation_config: dict = {}
    gc_path = path / GENERATION_CONFIG_FILE
    if gc_path.is_file():
        generation_config = _read_json(gc_path)
        files.append(gc_path)

    name_or_path = config.get("_name_or_path")
    if isinstance(name_or_path, str) and looks_like_hub_id(name_or_path):
        identifier = name_or_path
    else:
        identifier = path.resolve().name
    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        tokenizer_config=_neutral_tokenizer_config(tokenizer_config),
        chat_template=chat_template,
        generation_config=generation_config,
        identifier=identifier,
        source_files=sorted(set(files)),
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data


def _open_weights(path: Path) -> tuple[list[Path], dict[str, LazyTensor]]:
    index_path = path / WEIGHTS_INDEX
    handles = _Handles()
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportError(f"{index_path}: no weight_map")
        headers = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            if not shard_path.is_file():
                raise ExportError(f"{index_path}: shard '{shard}' is missing")
            headers[shard] = read_safetensors_header(shard_path)
        tensors = {}
        for name, shard in weight_map.items():
            entry = headers[shard].get(name)
            if entry is None:
                raise ExportError(f"{path / shard}: lacks tensor '{name}' that {WEIGHTS_INDEX} places there")
            tensors[name] = _lazy(handles, path / shard, name, entry)
        return [index_path, *(path / s for s in headers)], tensors
    single = path / SINGLE_WEIGHTS
    if single.is_file():
        header = read_safetensors_header(single)
        return [single], {name: _lazy(handles, single, name, entry) for name, entry in header.items()}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ExportError(f"{path}: has only PyTorch pickle weights; ignition reads safetensors only")
    if any(path.glob("*.safetensors")):
        raise ExportError(f"{path}: has safetensors shards but no {WEIGHTS_INDEX}")
    raise ExportError(f"{path}: no {SINGLE_WEIGHTS} or {WEIGHTS_INDEX}")


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype label, shape), after checking that every tensor's bytes lie within the file.

    NOTE: the check runs at open time, so a truncated download fails before any conversion work.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ExportError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        header_len = int.from_bytes(head, "little")
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise ExportError(
                f"{path}: truncated or corrupt safetensors file (header claims {header_len} bytes, file has {size})"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError:
        raise ExportError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path}: corrupt safetensors header")
    data_size = size - 8 - header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ExportError(f"{path}: corrupt safetensors header entry for '{name}'") from None
        if code not in _ST_DTYPES:
            raise ExportError(f"{path}: tensor '{name}' has dtype {code}, which ignition does not read")
        label, itemsize = _ST_DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        if not (0 <= begin <= end) or end - begin != numel * itemsize:
            raise ExportError(f"{path}: corrupt safetensors file: tensor '{name}' has a bad byte range")
        if end > data_size:
            raise ExportError(
                f"{path}: truncated safetensors file: tensor '{name}' ends at data byte {end}, "
                f"the file holds {data_size}"
            )
        out[name] = (label, shape)
    return out


class _Handles:
    """One safe_open handle per file, opened on first use and shared by that file's tensors.

    NOTE: a big MoE checkpoint has tens of thousands of tensors; reopening (and re-parsing the header) per
    tensor would cost more than the reads.
    """

    def __init__(self):
        self._open: dict[Path, object] = {}

    def get(self, file: Path, name: str) -> torch.Tensor:
        handle = self._open.get(file)
        if handle is None:
            from safetensors import safe_open

            handle = self._open[file] = safe_open(str(file), framework="pt")
        return handle.get_tensor(name)


def _lazy(handles: _Handles, file: Path, name: str, entry: tuple[str, tuple[int, ...]]) -> LazyTensor:
    label, shape = entry
    return LazyTensor(shape=shape, dtype=label, load=lambda: handles.get(file, name))


def _chat_template(path: Path, tokenizer_config: dict) -> tuple[str | None, list[Path]]:
    """chat_template.jinja wins, then chat_template.json, then tokenizer_config.json's field."""
    jinja = path / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), [jinja]
    tj = path / TEMPLATE_JSON_FILE
    if tj.is_file():
        template = _pick_template(_read_json(tj).get("chat_template"), tj)
        if template is not None:
            return template, [tj]
    return _pick_template(tokenizer_config.get("chat_template"), path / TOKENIZER_CONFIG_FILE), []


def _pick_template(value, where: Path) -> str | None:
    # HF allows a list of named templates; the one named "default" is what apply_chat_template uses.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise ExportError(f"{where}: chat_template list has no 'default' entry (has {sorted(map(str, named))})")
    raise ExportError(f"{where}: chat_template is neither a string nor a list")


def _neutral_tokenizer_config(tc: dict) -> dict:
    """tokenizer_config.json without its chat_template; AddedToken dicts of special tokens become strings."""
    out = {k: v for k, v in tc.items() if k != "chat_template"}
    for key in _TOKEN_KEYS:
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = value.get("content")
    return out
