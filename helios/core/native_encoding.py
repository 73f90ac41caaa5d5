"""The native prompt encoders by template kind (TemplateCaps.kind): models that ship their chat format as Python,
not Jinja. DeepSeek V4 / V4.1 (helios.core.deepseek_encoding) and Kimi K3 (helios.core.kimi_encoding); ignition
probes the one a core's kind names and the frontend renders with it. Imports those two modules only; no torch."""

from __future__ import annotations

from helios.core import deepseek_encoding, kimi_encoding

NativeEncoder = deepseek_encoding.DeepseekV4Encoding | kimi_encoding.KimiK3Encoding


def native_encoder(kind: str) -> NativeEncoder:
    """The encoder a core's template kind names (a TemplateError for an unknown kind)."""
    if kind == kimi_encoding.KIND:
        return kimi_encoding.KimiK3Encoding()
    return deepseek_encoding.native_encoder(kind)
