"""engines/mps_check.py: the GEMM self-check an engine runs when held to a share of the SMs."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import EngineError
from miles.engines.mps_check import check_gemms_under_sm_limit, gemm_errors

pytestmark = pytest.mark.timeout(60)


def test_gemm_errors_are_bf16_rounding_on_a_correct_blas() -> None:
    errs = gemm_errors(torch.device("cpu"))
    assert set(errs) == {f"{dt} {m}x1024x1024" for dt in ("bfloat16", "float16") for m in (8, 256)}
    assert all(0 < e < 0.02 for e in errs.values()), errs
    check_gemms_under_sm_limit(torch.device("cpu"), 40)  # a correct BLAS passes


def test_wrong_gemms_refuse_with_the_option_named() -> None:
    # a tolerance below bf16's own rounding stands in for a wrong BLAS: the same measured errors
    with pytest.raises(EngineError, match=r"engine.mps_thread_percent=40: .*bfloat16 256x1024x1024"):
        check_gemms_under_sm_limit(torch.device("cpu"), 40, tolerance=1e-6)
