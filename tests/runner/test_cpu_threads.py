"""helios.runner.cpu_threads: the decode thread policy's choices under hand-fed step times, and its premise
(a CPU decode step gives the same bits at every thread count)."""

from __future__ import annotations

import pytest
import torch

from helios.layers.attention import decode_attention
from helios.layers.linear import linear
from helios.layers.norm import rms_norm
from helios.runner.cpu_threads import DecodeThreads, same_bits_across_threads
from helios.runner.model_runner import decode_threads_are_exact
from tests.models.test_parity import prompt
from tests.runner.test_model_runner import core, greedy_reference, new, plan, runner, step  # noqa: F401

pytestmark = pytest.mark.usefixtures("default_threads")  # the machine's count, also on a pytest-xdist worker


def drive(policy: DecodeThreads, cost: dict[int, float], steps: int, num_seqs: int = 1) -> list[int]:
    chosen = []
    for _ in range(steps):
        t = policy.choose(num_seqs)
        policy.record(num_seqs, t, cost[t])
        chosen.append(t)
    return chosen


def test_tries_both_then_keeps_the_faster_and_backs_off_probing():
    policy = DecodeThreads(2, probe_interval=4, max_interval=16)
    chosen = drive(policy, {1: 0.10, 2: 0.05}, 60)
    assert chosen[:2] == [2, 1]  # the full count first, then one thread
    probes = [i for i, t in enumerate(chosen) if t == 1][1:]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 17  # 4, 8, 16 (+1 for the probe itself), then capped
    assert chosen.count(2) > 50


def test_switches_at_once_when_the_choice_becomes_slower_than_the_other():
    policy = DecodeThreads(2, probe_interval=4, max_interval=64)
    drive(policy, {1: 0.10, 2: 0.05}, 30)  # idle machine: two threads win
    after = drive(policy, {1: 0.10, 2: 1.0}, 12)  # other processes take the cores: 2 threads 10x slower
    assert after[:3] == [2, 1, 1] and after.count(2) <= 3  # switched at once; 2 threads only probed now
    # and back once the machine is idle again (found by the periodic probe)
    back = drive(policy, {1: 0.10, 2: 0.05}, 10)
    assert back[-1] == 2


def test_buckets_by_batch_size_and_one_thread_machines():
    policy = DecodeThreads(2, probe_interval=4)
    drive(policy, {1: 0.10, 2: 0.05}, 10, num_seqs=1)
    drive(policy, {1: 0.10, 2: 0.50}, 10, num_seqs=8)
    assert policy.buckets[1].best == 2 and policy.buckets[8].best == 1
    assert policy._bucket(5) is policy.buckets[8]
    assert drive(DecodeThreads(1), {1: 0.1}, 5) == [1] * 5


def test_runner_decodes_through_the_policy_and_restores_the_thread_count(runner):
    if runner.decode_threads is None:
        pytest.skip("thread counts give other bits on this machine: the policy is off (tested below)")
    ids = prompt(9)
    blocks = [3, 1, 5, 7]
    saved = torch.get_num_threads()
    out = runner.execute(plan([step("a", ids, 0, blocks)], new=[new("a", ids)]))
    tokens = [out.results[0].sampled_token_id]
    for _ in range(4):
        out = runner.execute(plan([step("a", tokens[-1:], len(ids) + len(tokens) - 1, blocks)]))
        tokens.append(out.results[0].sampled_token_id)
        assert torch.get_num_threads() == saved
    assert tokens == greedy_reference(runner, ids, 5)
    bucket = runner.decode_threads.buckets[1]
    assert set(bucket.cost) == {1, saved}  # both counts timed (one on a one-thread machine)
    # the prefill step: a bucket of its own where the family's prompt steps take the policy too
    assert set(runner.decode_threads.buckets) == ({1, ("prompt", 16)} if runner.prompt_threads else {1})


@pytest.mark.parametrize("num_rows", [1, 8])
def test_the_start_up_check_catches_thread_count_differences(num_rows):
    """The policy's premise at SmolLM2-135M's shapes (projections through F.linear and oneDNN, the norm, the
    batched decode attention): where 1 and 2 threads give other bits, same_bits_across_threads says so."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_rows, 576, generator=g)
    weights = [torch.randn(out, inp, generator=g) * 0.05 for out, inp in
               [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]]
    norm_weight = torch.randn(576, generator=g)
    kv_cache = torch.randn(2, 64, 16, 3, 64, generator=g)
    q = torch.randn(num_rows, 9, 64, generator=g)
    blocks = torch.randperm(64, generator=g)[: num_rows * 4].view(num_rows, 4)
    bias = torch.zeros(num_rows, 1, 1, 64)
    bias[..., 50:] = float("-inf")

    def outputs():
        ys = [linear(x if w.shape[1] == 576 else torch.cat([x] * 3, dim=1)[:, :1536], w) for w in weights]
        return ys + [rms_norm(x, norm_weight, 1e-5), decode_attention(q, kv_cache, blocks, bias, 0.125)]

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = outputs()
        torch.set_num_threads(2)
        two = outputs()
    finally:
        torch.set_num_threads(saved)
    direct = all(torch.equal(a, b) for a, b in zip(one, two))
    # where the counts differ (seen on a 16-core host at 8 rows), the start-up check must see it too
    checked = same_bits_across_threads(weights, 576, 9, 3, 64, 2)
    assert direct or not checked, "the start-up check missed a thread-count difference"


def test_the_policy_is_on_only_where_thread_counts_give_the_same_bits(runner):
    exact = decode_threads_are_exact(runner.model, runner.arch, torch.get_num_threads())
    assert (runner.decode_threads is not None) == exact


def test_steps_with_prompt_rows_have_buckets_of_their_own():
    """Keyed by token count alone (powers of two), apart from the decode-only steps of any batch size."""
    policy = DecodeThreads(2)
    prompt = policy._bucket(3, 100)
    assert prompt is policy.buckets[("prompt", 128)] is policy._bucket(8, 120)
    assert prompt is not policy._bucket(3) and policy._bucket(3) is policy.buckets[4]
    drive_prompt = [policy.choose(3, 100)]
    policy.record(3, drive_prompt[0], 1.0, 100)
    assert policy.choose(3, 100) == 1 and policy.choose(3) == 2  # the prompt bucket's next try; decode untouched
