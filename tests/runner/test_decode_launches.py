"""The kernels a graphed batch-1 decode step launches, and those of an eager 4096-token prompt step of the recurrent
and MoE families (benchmarks/decode_launches.py: the model on meta tensors, every Triton launch through the compile
hook, every torch op that launches a kernel), held at or below today's counts: on the GPU the step idles between
dependent kernels inside its graph, so a layer that grows a launch (a norm back on torch's five ops, an unfused
activation, a per-layer recomputation of a per-step value) costs every decode step without failing any value check;
a prompt step is host-bound when its launches outnumber what its work hides (qwen3_5_moe's launched 1456 kernels
before session 26, 595 after, and ran twice as fast). Lower counts pass; lower the bound with them. Run where Triton
compiles rather than interprets (a subprocess without the tests' TRITON_INTERPRET), as
tests/ignition/test_aot_traced.py does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helios.kernels._triton import HAS_TRITON
from tests.ignition.test_aot_traced import clean_env

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

# kernels a layer of each kind launches at most, and the rest of the step (embedding, final norm, head, inputs); the
# MoE shared experts' down GEMV with its activation folded in (gemv.GEMV_SMALL) took one a MoE layer off (session 29);
# a shared expert of the routed experts' shapes riding in their two launches (fused_moe's shared blocks), two or three
# more; no split-K GEMV (and its reduce launch) for a row tile a SM; mimo_v2_flash's narrow values without their pad
# and slice copies; a MoE layer's combine taking the next layer's add and norm (helios.layers.moe.chain_moe_norms);
# the routing in the router's launch (session 30)
BOUNDS = {
    "qwen3_5": ({"linear+mlp": 8, "full+mlp": 11}, 7),
    "qwen3_5_moe": ({"linear+moe": 9.1, "full+moe": 12}, 6),
    "nemotron_h": ({"linear+no-ffn": 5, "ffn+moe": 5, "full+no-ffn": 6, "ffn+mlp": 4}, 6),
    "mimo_v2_flash": ({"full+mlp": 10, "sliding+moe": 11.4}, 6),
    "kimi_linear": ({"linear+mlp": 7, "linear+moe": 8.1, "full+moe": 10}, 5),
    "glm5_next": ({"linear+mlp": 14, "full+moe": 23}, 8),
    "deepseek_v4": ({"full_attention+moe": 27}, 8),
    "minimax_m3": ({"full_attention+mlp": 14, "full_attention+moe": 16.5}, 6),
    "muse_spark": ({"full+mlp": 11, "sliding+moe": 17, "sliding+mlp": 11, "full+moe": 17}, 9),
    "gemma4": ({"sliding+mlp": 15.25, "full+mlp": 15.5}, 13),
    "step3p7": ({"full+mlp": 12, "sliding+mlp": 11, "sliding+moe": 15, "full+moe": 16}, 7),
    "qwen4_exp": ({"linear+moe": 12, "full+moe": 17}, 9),
}


def within_bounds(family: str, got: dict, layers: dict[str, float], step: int) -> None:
    assert set(got["layers"]) == set(layers), got
    over = {kind: n for kind, n in got["layers"].items() if n > layers[kind]}
    assert not over and got["step"] <= step, f"{family}: {got} (bounds {layers}, step {step})"


@pytest.fixture(scope="module")
def launches() -> dict:
    proc = subprocess.run([sys.executable, "benchmarks/decode_launches.py", "--families", ",".join(BOUNDS), "--json"],
                          capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", sorted(BOUNDS))
def test_a_decode_step_launches_no_more_kernels_than_today(launches, family):
    within_bounds(family, launches[family], *BOUNDS[family])


# an eager prompt step of a fresh 4096-token prompt (decode_launches.py --prefill): kernels a layer of each kind
# (a recurrent family's first layer also builds fla's chunk layout for the step), and the rest of the step
PREFILL_BOUNDS = {
    "qwen3_5": ({"linear+mlp": 21, "full+mlp": 11}, 7),
    "qwen3_5_moe": ({"linear+moe": 30, "full+moe": 19}, 6),
    "kimi_linear": ({"linear+mlp": 48, "linear+moe": 33.1, "full+moe": 25}, 5),
    "mimo_v2_flash": ({"full+mlp": 11, "sliding+moe": 16.4}, 7),
}


@pytest.fixture(scope="module")
def prefill_launches() -> dict:
    proc = subprocess.run([sys.executable, "benchmarks/decode_launches.py", "--families", ",".join(PREFILL_BOUNDS),
                           "--prefill", "4096", "--json"], capture_output=True, text=True, env=clean_env(), cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", sorted(PREFILL_BOUNDS))
def test_a_prompt_step_launches_no_more_kernels_than_today(prefill_launches, family):
    within_bounds(family, prefill_launches[family], *PREFILL_BOUNDS[family])
