"""Multi-token-prediction (MTP) draft modules: a checkpoint's MTP tensors -> the core's mtp.{k}.* namespace.

A family module names where its modules live (one prefix per module index) and their own roles (norms, the
embedding/hidden projection, the final norm); the module's decoder layer goes through the family's own layer
functions, fed a view that shows the module's tensors as one more layer of the model (index num_layers + k). So the
draft layer gets the exact shape checks and runtime layout of a main layer, then is renamed mtp.{k}.layer.*.
Every tensor under a module's prefix must find its place, else ExportError (docs/core-format.md, "Multi-token
prediction"). Family modules call this; helios maps the result and binds none of it yet.
"""

from __future__ import annotations

import dataclasses
import re

from helios.core.layout import MTP_PREFIX, layer
from ignition.archs import Plan, Weights
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor



def module_indices(ckpt: Checkpoint, roots: tuple[str, ...], pattern: str) -> list[int]:
    """The module indices k of the tensors under `roots` (the family's MTP prefixes), each name matching `pattern` (a
    regex whose one group is k), checked to run 0 .. n-1; [] when the checkpoint has no MTP tensors (transformers
    saves none). A tensor under a root that fits no module is an ExportError."""
    names = [name for name in ckpt.tensors if name.startswith(roots)]
    stray = [name for name in names if not re.match(pattern, name)]
    if stray:
        raise ExportError(f"{ckpt.identifier}: MTP tensor '{stray[0]}' is not in the published layout (a module "
                          f"matching {pattern})")
    found = sorted({int(re.match(pattern, name).group(1)) for name in names})
    if found != list(range(len(found))):
        raise ExportError(f"{ckpt.identifier}: MTP modules {found} are not numbered 0 .. {len(found) - 1}")
    return found


def check_count(ckpt: Checkpoint, cfg: dict, keys: tuple[str, ...], found: int) -> None:
    """The config's module count (the first of `keys` it sets) must equal the modules the checkpoint holds."""
    for key in keys:
        if cfg.get(key) is not None:
            if int(cfg[key]) != found:
                raise ExportError(f"{ckpt.identifier}: {key}={cfg[key]} but the checkpoint holds {found} MTP "
                                  "modules (export needs them all or none)")
            return


class ModuleView:
    """One MTP module's tensors (names starting `src`): `take`/`has` of its own roles by their name inside the
    module, and `weights`, a Weights over its decoder-layer tensors (under `src + layer_src`) renamed
    `layers.{index}.*` for the family's layer functions (`renames`: the module's own spelling of a main layer's
    tensor, applied to the name's start). `check_all_used` names any tensor of the module nothing consumed."""

    def __init__(self, ckpt: Checkpoint, src: str, layer_src: str, index: int, renames: dict[str, str] | None = None):
        self.identifier, self.src, self.tensors = ckpt.identifier, src, ckpt.tensors
        self.names = sorted(n for n in ckpt.tensors if n.startswith(src))
        self.used: set[str] = set()
        view, self.origin = {}, {}
        for name in self.names:
            inner = name[len(src):]
            if not inner.startswith(layer_src):
                continue
            rest = inner[len(layer_src):]
            for old, new in (renames or {}).items():
                rest = new + rest[len(old):] if rest.startswith(old) else rest
            view[f"layers.{index}.{rest}"], self.origin[f"layers.{index}.{rest}"] = ckpt.tensors[name], name
        # NOTE: Weights finds its prefix ("") by an embedding: the module has none of its own, any tensor stands in
        view["embed_tokens.weight"] = next(iter(ckpt.tensors.values()))
        self.weights = _LayerWeights(dataclasses.replace(ckpt, tensors=view), ("",))
        self.weights.module = src
        self.weights.skip("embed_tokens.weight")

    def has(self, name: str) -> bool:
        return self.src + name in self.tensors

    def take(self, name: str, shape: tuple[int, ...]) -> LazyTensor:
        """The module's tensor `src + name`, checked against `shape`."""
        full = self.src + name
        t = self.tensors.get(full)
        if t is None:
            raise ExportError(f"{self.identifier}: MTP module lacks tensor '{full}'")
        if tuple(t.shape) != tuple(shape):
            raise ExportError(f"{self.identifier}: tensor '{full}' has shape {list(t.shape)}, the config implies "
                              f"{list(shape)}")
        self.used.add(full)
        return t

    def check_all_used(self) -> None:
        used = {self.origin[n] for n in self.weights.used if n in self.origin} | self.used
        left = [n for n in self.names if n not in used]
        if left:
            shown = ", ".join(left[:5]) + (f", … ({len(left)} in all)" if len(left) > 5 else "")
            raise ExportError(f"{self.identifier}: MTP tensors with no place in the {self.src}* module: {shown}")


class _LayerWeights(Weights):
    """A module's decoder layer seen as a main layer: a missing or misshapen tensor is named within the module."""

    module = ""

    def take(self, name: str, shape: tuple[int, ...], root: bool = False) -> LazyTensor:
        try:
            return super().take(name, shape, root)
        except ExportError as e:
            raise ExportError(f"MTP module {self.module}* (its decoder layer as {name.split('.')[1]} of the "
                              f"model): {e}") from None


def add_module_layer(plan: Plan, layer_plan: Plan, index: int, k: int) -> None:
    """The family's plan of layer `index` (the module's decoder layer) into plan as mtp.{k}.layer.*."""
    head = layer(index, "")
    for name, producer in layer_plan.items():
        if not name.startswith(head):
            raise ExportError(f"MTP module {k}: its decoder layer produced {name!r} outside layer {index}")
        plan[f"{MTP_PREFIX}{k}.layer.{name[len(head):]}"] = producer


def layer_modules(ckpt: Checkpoint, prefixes: tuple[str, ...], num_layers: int) -> list[str]:
    """The sources of the MTP modules a checkpoint stores as decoder layers past the main ones (DeepSeek-V3's
    layout, which GLM and Step publish: `{prefix}layers.{num_layers + k}.`), in order k = 0 .. n-1; [] when there
    are none. Modules under two prefixes, or not numbered num_layers .. num_layers + n - 1, are an ExportError."""
    found: dict[int, set[str]] = {}
    for name in ckpt.tensors:
        for prefix in prefixes:
            m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
            if m:
                if int(m.group(1)) >= num_layers:
                    found.setdefault(int(m.group(1)) - num_layers, set()).add(prefix)
                break
    if sorted(found) != list(range(len(found))):
        raise ExportError(f"{ckpt.identifier}: MTP layers {sorted(k + num_layers for k in found)} are not numbered "
                          f"{num_layers} .. {num_layers + len(found) - 1} (the layers past num_hidden_layers)")
    if any(len(p) > 1 for p in found.values()):
        raise ExportError(f"{ckpt.identifier}: an MTP layer is stored under more than one prefix")
    return [f"{found[k].pop()}layers.{num_layers + k}." for k in range(len(found))]


def take_copies(view: ModuleView, vocab_size: int, hidden_size: int) -> None:
    """A DeepSeek-V3-style module's copies of the embedding and output head (embed_tokens, shared_head.head, Step's
    shared_head.output), checked by shape and not stored: transformers' MtpModel drafts with the main model's
    embedding and lm_head and never reads them, and so does the core (docs/core-format.md)."""
    for name in ("embed_tokens.weight", "shared_head.head.weight", "shared_head.output.weight"):
        if view.has(name):
            view.take(name, (vocab_size, hidden_size))
