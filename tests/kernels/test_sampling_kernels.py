"""Row log-sum-exp kernel (incl. batch invariance) and the exact top-N logprob selection."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import require_interpreter

require_interpreter()

# the interpreter (numpy) warns on exp overflow / log(0) where the GPU quietly gives inf / -inf
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tests.kernels import checks  # noqa: E402


def test_argmax_rows():
    checks.check_argmax_rows("cpu")


def test_exponential_log_noise():
    checks.check_exponential_log_noise("cpu")


def test_row_logsumexp():
    checks.check_row_logsumexp("cpu")


def test_top_logprobs():
    checks.check_top_logprobs("cpu")
