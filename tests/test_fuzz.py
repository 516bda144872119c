"""A fixed-seed slice of the differential fuzzer (``python -m attncomp.fuzz`` runs more)."""

import pytest

pytest.importorskip("hypothesis")

from attncomp.fuzz import Case, fuzz, run_case  # noqa: E402


@pytest.mark.long
def test_fixed_seed_slice_has_no_mismatch():
    assert fuzz(cases=200, seed=20261121, cpu_every=100) == 200


def test_a_wrong_result_is_reported_with_a_spec_file(tmp_path, monkeypatch):
    import attncomp.fuzz as fuzz_module

    case = Case(score=["s = s * 2.0"], mask="j <= i", sizes={"B": 1, "H": 1, "T": 5, "S": 5, "D": 4}, pipeline="")
    assert run_case(case, tmp_path) is None
    real = fuzz_module.worst_error
    monkeypatch.setattr(fuzz_module, "worst_error", lambda got, want: real(got, want) + 1.0)
    assert "relative error" in run_case(case, tmp_path)
    assert "def fuzzed(" in case.source() and "s = ac.where(j <= i, s, -ac.inf)" in case.source()
