"""The multi-token-prediction (MTP) draft modules a checkpoint carries go to the core's mtp.{k}.* (docs/core-format.md)
with Architecture.mtp, and the core still serves its main model exactly as without them.

transformers neither builds nor saves MTP weights for these families (it drops them on load), so each tiny checkpoint
gets them written in with the published names (DeepSeek-V4: mtp.{k}.*; MiMo-V2-Flash: model.mtp.layers.{k}.*;
Qwen3.5 / Qwen3-Next: mtp.fc / pre_fc_norm_* / norm / layers.0.*; GLM-5.3-Flash and Step-3.5/3.7-Flash: the layers past
num_hidden_layers with enorm / hnorm / eh_proj / shared_head.*, and copies of the embedding / head not stored). A module's decoder layer is a main layer's tensors
doubled (exact in float32), so its core tensors must equal, bit for bit, what the family exports for that layer when
the checkpoint's main layer holds the doubled tensors instead (the swap checkpoint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helios.core.manifest import MtpConfig
from ignition.errors import ExportError
from tests.ignition.checkpoint_tools import convert_all, core_files, edit_config, raw_tensors, write_tensors
from tests.ignition.tiny_models import VOCAB_SIZE
from tests.models.hybrid_harness import generate, greedy_request, make_engine, prompt

H = 64  # every tiny builder's hidden size


def _build(family: str, out: Path) -> Path:
    if family == "deepseek_v4":
        from tests.models.deepseek_v4_tiny import build_deepseek_v4

        path = build_deepseek_v4(out)
        # the published config lists the MTP block's layer kind past the main layers' (DeepseekV4Config cuts it)
        cfg = json.loads((path / "config.json").read_text())
        cfg["layer_types"] = [*cfg["layer_types"], "heavily_compressed_attention"]
        (path / "config.json").write_text(json.dumps(cfg))
        return path
    if family == "mimo_v2_flash":
        from tests.models.mimo_v2_flash_tiny import build_mimo

        # layer 1: sliding with a dense MLP, as every MiMo MTP layer is
        return build_mimo(out, mlp_layer_types=["dense", "dense", "sparse", "sparse"])
    if family == "step3p7":
        from tests.models.step3p7_tiny import build_step3p7

        path = build_step3p7(out)  # its MTP layer: full, MoE (the saved mtp_layer_types / mtp_mlp_layer_types)
        # the release pads the clamp lists with the MTP layer's entry (transformers drops it): it lands in [arch.mtp]
        edit_config(path, lambda text: {**text, "swiglu_limits": [*text["swiglu_limits"], 0.2]})
        return path
    if family == "glm5_next":
        from tests.models.glm5_next_tiny import build_glm5_next

        return build_glm5_next(out)  # layer 3: MLA + its own DSA indexer + experts, as the published MTP block
    from tests.models.hybrid_tiny import build_hybrid

    return build_hybrid("qwen3_5", out)


# family -> (the main layer j the module copies, its tensors' prefix, the module's layer prefix, renames main -> module,
#            the module's own roles: published name -> (core role, norm stored as 1 + w))
_LAYOUTS = {
    "deepseek_v4": (2, "model.layers.2.", "mtp.0.", {}, {
        "enorm.weight": ("enorm.weight", False), "hnorm.weight": ("hnorm.weight", False),
        "e_proj.weight": ("e_proj.weight", False), "h_proj.weight": ("h_proj.weight", False),
        "norm.weight": ("norm.weight", False), "hc_head_fn": ("hc_head.proj.weight", False),
        "hc_head_base": ("hc_head.bias", False), "hc_head_scale": ("hc_head.scale", False)}),
    "mimo_v2_flash": (1, "model.layers.1.", "model.mtp.layers.0.",
                      {"post_attention_layernorm.": "pre_mlp_layernorm."}, {
        "enorm.weight": ("enorm.weight", False), "hnorm.weight": ("hnorm.weight", False),
        "eh_proj.weight": ("eh_proj.weight", False), "final_layernorm.weight": ("norm.weight", False)}),
    "qwen3_5": (3, "model.layers.3.", "mtp.layers.0.", {}, {
        "mtp.pre_fc_norm_embedding.weight": ("enorm.weight", True), "mtp.pre_fc_norm_hidden.weight": ("hnorm.weight", True),
        "mtp.fc.weight": ("eh_proj.weight", False), "mtp.norm.weight": ("norm.weight", True)}),
    "step3p7": (3, "model.layers.3.", "model.layers.5.", {}, {
        "enorm.weight": ("enorm.weight", True), "hnorm.weight": ("hnorm.weight", True),
        "eh_proj.weight": ("eh_proj.weight", False), "shared_head.norm.weight": ("norm.weight", True)}),
    "glm5_next": (3, "model.language_model.layers.3.", "model.language_model.layers.4.", {}, {
        "enorm.weight": ("enorm.weight", False), "hnorm.weight": ("hnorm.weight", False),
        "eh_proj.weight": ("eh_proj.weight", False), "shared_head.norm.weight": ("norm.weight", False)}),
}
# the embedding / output-head copies a DeepSeek-V3-style module stores: checked by shape, not exported
_COPIES = {"step3p7": ("shared_head.output.weight",), "glm5_next": ("embed_tokens.weight", "shared_head.head.weight")}
# a name that fits no module: refused by the module finder, or (in the layouts that own a whole prefix) left unplaced
_STRAY = {"qwen3_5": ("mtp.extra.weight", "no place in the mtp."),
          "deepseek_v4": ("mtp.norm.weight", "not in the published layout"),
          "mimo_v2_flash": ("model.mtp.norm.weight", "not in the published layout"),
          "step3p7": ("model.layers.5.extra.weight", "no place in the model.layers.5."),
          "glm5_next": ("model.language_model.layers.4.mlp.extra", "no place in the model.language_model.layers.4.")}
_SHAPES = {"e_proj.weight": (H, H), "h_proj.weight": (H, H), "eh_proj.weight": (H, 2 * H), "mtp.fc.weight": (H, 2 * H),
           "hc_head_fn": (2, 2 * H), "hc_head_base": (2,), "hc_head_scale": (1,)}
_EXPECTED = {
    "deepseek_v4": MtpConfig(num_modules=1, layout="deepseek_v4", layer_kinds=["hca"], moe_modules=[0]),
    "mimo_v2_flash": MtpConfig(num_modules=1, layout="mimo_v2_flash", layer_kinds=["sliding"]),
    "qwen3_5": MtpConfig(num_modules=1, layout="qwen3_next", layer_kinds=["full"]),
    "step3p7": MtpConfig(num_modules=1, layout="step3p7", layer_kinds=["full"], moe_modules=[0], swiglu_limits=[0.2]),
    "glm5_next": MtpConfig(num_modules=1, layout="glm5_next", layer_kinds=["full"], moe_modules=[0]),
}


def _module_tensors(family: str, raw: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(the MTP tensors to write in, the swap checkpoint's main-layer tensors): the module's decoder layer is main
    layer j doubled; its own roles are random."""
    j, main, module, renames, roles = _LAYOUTS[family]
    gen = torch.Generator().manual_seed(7)
    mtp, swap = {}, {}
    for name, t in raw.items():
        if name.startswith(main):
            rest = name[len(main):]
            for old, new in renames.items():
                rest = new + rest[len(old):] if rest.startswith(old) else rest
            mtp[module + rest], swap[name] = 2 * t, 2 * t
    own = "" if family == "qwen3_5" else module
    for name in roles:
        mtp[own + name] = torch.randn(_SHAPES.get(name, (H,)), generator=gen)
    for name in _COPIES.get(family, ()):
        mtp[module + name] = torch.randn(VOCAB_SIZE, H, generator=gen)
    return mtp, swap


def _renumbered(family: str, name: str, k: int) -> str:
    """`name` of module 0 as module k's."""
    module = _LAYOUTS[family][2]
    if family in ("step3p7", "glm5_next"):  # the layer past the main ones: layers.{N + k}.
        n = int(module.rstrip(".").rsplit(".", 1)[1])
        return name.replace(f"layers.{n}.", f"layers.{n + k}.", 1)
    return name.replace(".0.", f".{k}.", 1) if ".0." in name else name


def _copied(family: str, mtp: dict, k: int) -> dict:
    """Module 0's tensors again as module k (its renamed tensors only)."""
    return {_renumbered(family, n, k): t.clone() for n, t in mtp.items() if _renumbered(family, n, k) != n}


@pytest.fixture(scope="module", params=sorted(_LAYOUTS))
def case(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    src = _build(family, root / "src")
    raw = raw_tensors(src)
    mtp, swap = _module_tensors(family, raw)
    with_mtp = shutil.copytree(src, root / "mtp")
    write_tensors(with_mtp, {**raw, **mtp})
    swapped = shutil.copytree(src, root / "swap")
    write_tensors(swapped, {**raw, **swap})
    return family, src, with_mtp, mtp, convert_all(src), convert_all(with_mtp), convert_all(swapped)[1]


def test_every_mtp_tensor_lands_in_the_core_exactly(case):
    family, _, _, mtp, (arch0, plain), (arch, got), swapped = case
    j, _, _, _, roles = _LAYOUTS[family]
    assert arch.mtp == _EXPECTED[family]
    assert msgspec_replace(arch, mtp=None) == arch0 and arch0.mtp is None
    main = {n: t for n, t in got.items() if not n.startswith("mtp.")}
    assert sorted(main) == sorted(plain) and all(torch.equal(main[n], plain[n]) for n in plain)
    layer = {n.removeprefix(f"layers.{j}."): t for n, t in swapped.items() if n.startswith(f"layers.{j}.")}
    drafted = {n.removeprefix("mtp.0.layer."): t for n, t in got.items() if n.startswith("mtp.0.layer.")}
    assert sorted(drafted) == sorted(layer) and all(torch.equal(drafted[n], layer[n]) for n in layer)
    own = "" if family == "qwen3_5" else _LAYOUTS[family][2]
    for name, (role, shifted) in roles.items():
        want = mtp[own + name] + 1.0 if shifted else mtp[own + name]
        assert torch.equal(got[f"mtp.0.{role}"], want), role
    assert len(got) == len(plain) + len(roles) + len(layer)


def test_the_core_records_it_and_serves_the_same_tokens(case, tmp_path):
    """The manifest's [arch.mtp], byte-identical re-exports, the runner's start-up line, and 8 greedy tokens equal to
    the core without MTP's."""
    from helios.core.load import load_core
    from ignition.export import export_core

    family, src, with_mtp, *_ = case
    a, b = export_core(with_mtp, tmp_path / "a"), export_core(with_mtp, tmp_path / "b")
    assert core_files(a) == core_files(b)
    core, plain = load_core(a), load_core(export_core(src, tmp_path / "plain"))
    assert core.manifest.arch.mtp == _EXPECTED[family] and "[arch.mtp]" in (a / "core.toml").read_text()
    assert sum(n.startswith("mtp.") for n in core.tensors) == len(core.tensors) - len(plain.tensors)
    outputs, runners = [], []
    for c in (core, plain):
        engine = make_engine(c, max_concurrency=2, num_pages=64)
        outputs.append(generate(engine, [greedy_request("r", prompt(20), 8)]))
        runners.append(engine.runner)
    assert outputs[0] == outputs[1]
    drafted = sorted(n for n in core.tensors if n.startswith("mtp."))
    assert sorted(runners[0].draft_tensors) == drafted and not runners[1].draft_tensors
    assert f"{len(drafted)} MTP draft tensors mapped" in runners[0].startup.summary()
    assert "MTP" not in runners[1].startup.summary()


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


@pytest.mark.parametrize("edit, message", [
    (lambda f, mtp: {n: t for n, t in mtp.items() if not n.endswith(("enorm.weight", "embedding.weight"))},
     "MTP module lacks tensor"),
    (lambda f, mtp: {**mtp, next(iter(mtp)).rsplit(".", 1)[0] + ".bias": torch.zeros(1)}, "no place|lacks"),
    (lambda f, mtp: {**mtp, **_copied(f, mtp, 1)}, "holds 2 MTP|2 lay"),
    (lambda f, mtp: {**mtp, **_copied(f, mtp, 2)}, "not numbered"),
    (lambda f, mtp: {n: t[..., :-1] if t.dim() == 2 else t for n, t in mtp.items()}, "has shape"),
])
def test_a_rejected_layout_names_what_is_wrong(case, tmp_path, edit, message):
    """A module missing a role, with a tensor too many, one more than the config counts (or than qwen's single layer),
    numbered with a gap, or misshapen: each an ExportError saying so."""
    family, src, _, mtp, *_ = case
    path = shutil.copytree(src, tmp_path / "bad")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = cfg["mtp_num_hidden_layers"] = 1  # the published configs count their modules
    if "text_config" in cfg:
        cfg["text_config"]["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    write_tensors(path, {**raw_tensors(src), **edit(family, mtp)})
    with pytest.raises(ExportError, match=message):
        convert_all(path)


def test_a_stray_mtp_name_is_refused(case, tmp_path):
    family, src, _, mtp, *_ = case
    name, message = _STRAY[family]
    path = shutil.copytree(src, tmp_path / "stray")
    write_tensors(path, {**raw_tensors(src), **mtp, name: torch.zeros(H)})
    with pytest.raises(ExportError, match=message):
        convert_all(path)
