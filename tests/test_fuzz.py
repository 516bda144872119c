"""A fixed-seed slice of the differential fuzzer (``python -m attncomp.fuzz`` runs more)."""

import pytest

pytest.importorskip("hypothesis")

from attncomp.fuzz import Case, fuzz, run_case  # noqa: E402


@pytest.mark.long
def test_fixed_seed_slice_has_no_mismatch():
    assert fuzz(cases=200, seed=20261121, cpu_every=100, paths_every=5) == 200


def test_a_wrong_result_is_reported_with_a_spec_file(tmp_path, monkeypatch):
    import attncomp.fuzz as fuzz_module

    case = Case(score=["s = s * 2.0"], mask="j <= i", sizes={"B": 1, "H": 1, "T": 5, "S": 5, "D": 4}, pipeline="")
    assert run_case(case, tmp_path) is None
    real = fuzz_module.worst_error
    monkeypatch.setattr(fuzz_module, "worst_error", lambda got, want: real(got, want) + 1.0)
    assert "relative error" in run_case(case, tmp_path)
    assert "def fuzzed(" in case.source() and "s = ac.where(j <= i, s, -ac.inf)" in case.source()


def test_the_paths_that_split_a_sequence_report_a_wrong_merge(tmp_path, monkeypatch):
    """A case run chunked, decoded and paged agrees with its whole sequence; a merge that keeps
    only its first part is reported, naming the path and its chunks."""
    pytest.importorskip("dask")
    import attncomp.chunked.tasks as tasks
    from attncomp.fuzz import load_case
    from attncomp.fuzz_paths import run_paths

    sizes = {"B": 2, "H": 1, "T": 12, "S": 12, "D": 4}
    case = Case(score=["s = s * 2.0"], mask="i - j < 5", sizes=sizes, pipeline="", lse=True, top=True)
    assert "ac.max(s, axis=-1), ac.logsumexp(s, axis=-1)" in case.source()
    assert run_paths(case, lambda c: load_case(c, tmp_path), seed=0) is None
    monkeypatch.setattr(tasks, "merge", lambda first, second: first)
    assert "chunked, chunks of" in run_paths(case, lambda c: load_case(c, tmp_path), seed=0)
