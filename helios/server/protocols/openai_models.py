"""GET /v1/models and /v1/models/{model}: the loaded model's vLLM-compatible card plus the `flare` object.

Cards are stable for the life of the process (created and permission ids come from Serving). No torch.
"""

from __future__ import annotations

from helios.server.errors import model_not_found
from helios.server.runtime import Runtime


def _flare(runtime: Runtime) -> dict:
    m, s = runtime.manifest, runtime.serving
    vision = m.vision
    return {
        "vocab_size": m.arch.vocab_size,
        "max_top_logprobs": m.logprobs.max_top_logprobs,
        "max_concurrency": s.max_concurrency,
        "prefill_chunk_size": s.prefill_chunk_size,
        "default_max_tokens": s.default_max_tokens,
        "sampling_defaults": _all_defaults(m),
        "thinking_token_budget": s.thinking_token_budget,
        "sampling_ranges": _ranges(m),
        "max_images_per_prompt": vision.max_images_per_prompt if vision.enabled else 0,
        "max_image_tokens_per_prompt": vision.max_image_tokens_per_prompt if vision.enabled else 0,
        "image_feature_window_tokens": vision.image_feature_window_tokens if vision.enabled else 0,
        "max_image_tokens_per_image": vision.max_image_tokens_per_image if vision.enabled else 0,
        "max_image_pixels": vision.max_image_pixels if vision.enabled else 0,
        "max_image_bytes": vision.max_image_bytes if vision.enabled else 0,
        "input_modalities": ["text", "image"] if vision.enabled else ["text"],
        "output_modalities": ["text"],
    }


def _all_defaults(m) -> dict:
    # NOTE: the manifest Structs omit defaults when encoding; the card lists every field explicitly.
    d = m.sampling.defaults
    return {f: getattr(d, f) for f in d.__struct_fields__}


def _ranges(m) -> dict:
    r = m.sampling.ranges
    out = {}
    for f in r.__struct_fields__:
        rng = getattr(r, f)
        out[f] = None if rng is None else {"min": rng.min, "max": rng.max}
    return out


def card(runtime: Runtime) -> dict:
    s = runtime.serving
    return {
        "id": s.model_id,
        "object": "model",
        "created": s.created,
        "owned_by": "local",
        "root": runtime.manifest.model.id,
        "parent": None,
        "max_model_len": s.max_model_len,
        "permission": [{
            "id": s.permission_id,
            "object": "model_permission",
            "created": s.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": runtime.manifest.logprobs.max_top_logprobs > 0,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }],
        "flare": _flare(runtime),
    }


def list_models(runtime: Runtime) -> dict:
    return {"object": "list", "data": [card(runtime)]}


def get_model(runtime: Runtime, name: str) -> dict:
    if name not in runtime.serving.names:
        raise model_not_found(name)
    return card(runtime)
