"""The command line, called in process: ``attncomp.cli.main([...])``."""

from __future__ import annotations

import re
import textwrap

import pytest

import attncomp as ac
from attncomp.cli import main

SPEC_FILE = textwrap.dedent(
    """\
    import attncomp as ac


    @ac.spec
    def attn(q: ac.f32["B", "T", "D"], k: ac.f32["B", "S", "D"], v: ac.f32["B", "S", "D"], *, window=8):
        s = q @ k.mT * q.shape[-1] ** -0.5
        b, i, j = ac.index(s)
        s = ac.where(i - j < window, s, -ac.inf)
        return ac.softmax(s) @ v


    not_a_spec = 3
    """
)

ATTN_IR = """\
ac.func @attn(%q: tensor<B x T x D x f32>, %k: tensor<B x S x D x f32>, %v: tensor<B x S x D x f32>) \
-> tensor<B x T x D x f32> attributes {window = WINDOW} {
  %0 = ac.transpose %k {perm = [0, 2, 1]} : tensor<B x D x S x f32>
  %1 = ac.matmul %q, %0 : tensor<B x T x S x f32>
  %2 = ac.dim {value = D} : tensor<i64>
  %3 = ac.constant {value = -0.5} : tensor<f32>
  %4 = ac.pow %2, %3 : tensor<f32>
  %s = ac.mul %1, %4 : tensor<B x T x S x f32>
  %i = ac.iota {axis = 1} : tensor<1 x T x 1 x i64>
  %j = ac.iota {axis = 2} : tensor<1 x 1 x S x i64>
  %5 = ac.sub %i, %j : tensor<1 x T x S x i64>
  %6 = ac.constant {value = WINDOW} : tensor<i64>
  %7 = ac.cmp %5, %6 {pred = "lt"} : tensor<1 x T x S x i1>
  %8 = ac.constant {value = -inf} : tensor<f32>
  %s_1 = ac.where %7, %s, %8 : tensor<B x T x S x f32>
  %9 = ac.softmax %s_1 {axis = 2} : tensor<B x T x S x f32>
  %out = ac.matmul %9, %v : tensor<B x T x D x f32>
  ac.return %out
}
"""


def attn_ir(window: int = 8) -> str:
    return ATTN_IR.replace("WINDOW", str(window))


@pytest.fixture
def target(tmp_path) -> str:
    path = tmp_path / "spec_file.py"
    path.write_text(SPEC_FILE)
    return f"{path}:attn"


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attncomp")
    assert re.search(r"^\s+ir\s+print the IR of a spec", out, re.M)
    assert re.search(r"^\s+check\s+run a spec on random inputs", out, re.M)
    assert re.search(r"^\s+bench\s+time a spec", out, re.M)


def test_command_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_ir_prints_the_spec_ir(target, capsys):
    assert main(["ir", target]) == 0
    out = capsys.readouterr().out
    assert out == attn_ir()
    assert str(ac.parse_ir(out)) == out


def test_ir_with_a_constant(target, capsys):
    assert main(["ir", target, "--const", "window=3"]) == 0
    assert capsys.readouterr().out == attn_ir(3)


def test_ir_print_after_all(target, capsys):
    assert main(["ir", target, "--print-after-all", "--pipeline", "cse,dce"]) == 0
    out = capsys.readouterr().out
    headers = re.findall(r"^// ----- after (\S+) -----$", out, re.M)
    assert headers == ["input", "cse", "dce"]
    chunks = re.split(r"^// ----- after \S+ -----\n", out, flags=re.M)[1:]
    assert chunks[0].rstrip("\n") + "\n" == attn_ir()
    for chunk in chunks:
        text = chunk.rstrip("\n") + "\n"
        assert str(ac.parse_ir(text)) == text


def test_ir_print_after_all_with_the_default_pipeline(target, capsys):
    assert main(["ir", target, "--print-after-all"]) == 0
    out = capsys.readouterr().out
    stages = ac.compile(ac.parse_ir(attn_ir()), backend="interp").stages
    assert re.findall(r"^// ----- after (\S+) -----$", out, re.M) == ["input", *stages]


def test_ir_print_after_one_pass(target, capsys):
    assert main(["ir", target, "--pipeline", "cse,dce", "--print-after", "cse"]) == 0
    assert capsys.readouterr().out == attn_ir()


def test_ir_backward_prints_its_stages(target, capsys):
    assert main(["ir", target, "--backward", "--print-after-all"]) == 0
    out = capsys.readouterr().out
    stages = re.findall(r"^// ----- after (\S+) -----$", out, re.M)
    assert stages[:4] == ["input", "cse", "softmax-fusion", "autodiff"]
    assert "ac.key_grid" in out.split("// ----- after flash-tiling -----")[1]
    assert main(["ir", target, "--backward", "--print-after", "autodiff"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ac.func @attn_backward(") and "ac.attention_grad" in text


def test_ir_timing(target, capsys):
    assert main(["ir", target, "--pipeline", "cse,dce", "--timing"]) == 0
    out = capsys.readouterr().out
    ir, _, timings = out.partition("// pass timings\n")
    assert ir == attn_ir()
    lines = timings.splitlines()
    assert len(lines) == 2
    for line, name in zip(lines, ["cse", "dce"]):
        assert re.fullmatch(rf"//   {name}\s+\d+\.\d{{3}} ms", line), line


def test_ir_unknown_stage(target, capsys):
    assert main(["ir", target, "--pipeline", "cse", "--print-after", "xyz"]) == 2
    assert capsys.readouterr().err == "attncomp: error: no stage 'xyz'; stages: input, cse, final\n"


def test_ir_unknown_pass(target, capsys):
    assert main(["ir", target, "--pipeline", "bogus"]) == 2
    assert capsys.readouterr().err.startswith("attncomp: error: unknown pass 'bogus'; valid passes: ")


def test_check_passes_on_the_interpreter(target, capsys):
    code = main(["check", target, "--dims", "B=1,T=4,S=5,D=3", "--backend", "interp"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("attn on interp [")
    assert lines[1] == "  sizes: B=1, T=4, S=5, D=3"
    assert re.fullmatch(r"  relative error \d\.\d{3}e[-+]\d\d \(tolerance 2\.0e-05\): ok", lines[2])
    assert "relative error" in out


def test_check_reports_a_mismatch(target, capsys):
    code = main(["check", target, "--dims", "B=1,T=4,S=5,D=3", "--backend", "interp", "--tol", "0"])
    assert code == 1  # an f32 result differs from the float64 reference by rounding
    assert ": MISMATCH" in capsys.readouterr().out


def test_check_with_missing_dims(target, capsys):
    assert main(["check", target, "--dims", "B=1,T=4", "--backend", "interp"]) == 2
    assert capsys.readouterr().err.strip() == "attncomp: error: --dims: give sizes for D, S (the spec uses B, D, S, T)"


def test_check_with_bad_dims(target, capsys):
    assert main(["check", target, "--dims", "B=1,T=x"]) == 2
    assert capsys.readouterr().err.strip() == "attncomp: error: --dims: expected NAME=INT, got 'T=x'"


def test_check_needs_dims(target, capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", target])
    assert info.value.code == 2
    assert "the following arguments are required: --dims" in capsys.readouterr().err


def test_target_without_a_spec_name(tmp_path, target, capsys):
    path = target.rpartition(":")[0]
    assert main(["ir", path]) == 2
    assert capsys.readouterr().err.strip() == f"attncomp: error: expected FILE.py:SPEC, got {path!r}"


def test_target_file_missing(tmp_path, capsys):
    missing = tmp_path / "nope.py"
    assert main(["ir", f"{missing}:attn"]) == 2
    assert capsys.readouterr().err.strip() == f"attncomp: error: no such file: {missing}"


def test_target_spec_missing(target, capsys):
    path = target.rpartition(":")[0]
    for name in ["attention", "not_a_spec"]:
        assert main(["ir", f"{path}:{name}"]) == 2
        assert capsys.readouterr().err.strip() == f"attncomp: error: {path} has no spec {name!r}; specs there: attn"


def test_target_whose_spec_does_not_trace(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("import attncomp as ac\n\n@ac.spec\ndef f(x: ac.f32['T']):\n    return x.bogus\n")
    assert main(["ir", f"{path}:f"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attncomp: error: {path}:5: AttributeError: 'Tensor' object has no attribute 'bogus'")


def test_check_on_the_cpu_backend(target, capsys):
    code = main(["check", target, "--dims", "B=1,T=20,S=30,D=8", "--backend", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "attn on cpu [cse, softmax-fusion, flash-tiling" in out and ": ok" in out


def test_bench_times_a_spec(target, capsys):
    assert main(["bench", target, "--dims", "B=1,T=20,S=30,D=8", "--backend", "interp", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 calls: min" in out and "median" in out
