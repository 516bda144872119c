"""``python -m benchmarks.kernel_report``: the SASS reader on a hand-written excerpt, the occupancy
arithmetic, and one kernel assembled and counted end to end (numba-cuda, nvJitLink and nvdisasm
from the ``cuda`` extra; no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.kernel_report import occupancy, sass

EXCERPT = """
	.target	sm_90

//--------------------- .text.__cuda_sm20_div_s64 --------------------------
	.section	.text.__cuda_sm20_div_s64,"ax",@progbits
__cuda_sm20_div_s64:
        /*0000*/                   IADD3 R0, R1, R2, RZ ;
        /*0010*/                   RET.REL.NODEC R20 `(kernel) ;

//--------------------- .text.kernel --------------------------
	.section	.text.kernel,"ax",@progbits
        .global         kernel
        .type           kernel,@function
kernel:
.text.kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.U16 R4, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0030*/              @!PT LDS RZ, [RZ] ;
.L_x_1:
        /*0040*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR4][R2.64] ;
        /*0050*/               @P0 LDG.E.U16 R12, desc[UR4][R2.64+0x2] ;
        /*0060*/                   STS [R7], R12 ;
.L_x_2:
        /*0070*/                   LDS.U16 R13, [R7+0x2] ;
        /*0080*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0090*/              @!P1 BRA `(.L_x_2) ;
        /*00a0*/                   LDSM.16.M88.4 R16, [R9] ;
        /*00b0*/                   HMMA.16816.F32.BF16 R20, R16, R24, R20 ;
        /*00c0*/                   HMMA.16816.F32.BF16 R28, R16, R26, R28 ;
        /*00d0*/                   LDS.64 R14, [R9+0x40] ;
        /*00e0*/                   HMMA.16816.F32.BF16 R32, R14, R24, R32 ;
        /*00f0*/                   ISETP.GE.AND P2, PT, R3, R4, PT ;
        /*0100*/              @!P2 BRA `(.L_x_1) ;
        /*0110*/                   BRA.DIV UR4, `(.L_x_3) ;
        /*0120*/                   HMMA.16816.F32.BF16 R36, R14, R24, R36 ;
        /*0130*/                   STG.E.U16 desc[UR4][R2.64], R20 ;
        /*0140*/                   EXIT ;
.L_x_3:
        /*0150*/                   BRA `(.L_x_3);
        /*0160*/                   NOP;
        /*0170*/                   NOP;
.L_x_4:
"""


def test_parse_functions_and_instructions():
    functions = sass.parse(EXCERPT)
    assert [(f.name, f.entry) for f in functions] == [("__cuda_sm20_div_s64", False), ("kernel", True)]
    (kernel,) = sass.kernels(functions)
    assert len(kernel.instructions) == 22  # NOP padding not counted
    assert sass.count(kernel.instructions, "HMMA") == 4
    first = kernel.instructions[1]
    assert (first.address, first.opcode, first.predicate) == (0x10, "LDG.E.U16", "")
    assert kernel.instructions[5].predicate == "@P0" and kernel.instructions[3].never
    assert kernel.labels[".L_x_1"] == 4 and kernel.labels[".L_x_2"] == 7


def test_memory_operations_by_kind_and_width():
    (kernel,) = sass.kernels(sass.parse(EXCERPT))
    assert sass.memory(kernel.instructions) == {  # the @!PT LDS never executes: left out
        "LDG.E.U16": 2,
        "LDG.E.128": 1,
        "LDGSTS.E.BYPASS.128": 1,
        "LDSM.16.M88.4": 1,
        "LDS.U16": 1,
        "LDS.64": 1,
        "STS": 1,
        "STG.E.U16": 1,
    }
    widths = {op: sass.width(op) for op in ("LDG.E.U16", "LDG.E.128", "LDGSTS.E.BYPASS.128", "LDS.U16", "LDS.64")}
    assert widths == {"LDG.E.U16": 16, "LDG.E.128": 128, "LDGSTS.E.BYPASS.128": 128, "LDS.U16": 16, "LDS.64": 64}
    assert sass.width("STS") == 32 and sass.width("LDSM.16.M88.4") == 128 and sass.width("LDSM.16.MT88.2") == 64


def test_main_loop_is_the_innermost_loop_with_the_most_hmma():
    (kernel,) = sass.kernels(sass.parse(EXCERPT))
    found = {(loop.label, loop.instructions, loop.hmma) for loop in sass.loops(kernel)}
    # the inner loop, the main loop, and the padding's branch to itself; BRA.DIV is not a loop
    assert found == {(".L_x_2", 3, 0), (".L_x_1", 13, 3), (".L_x_3", 1, 0)}
    loop = sass.main_loop(kernel)
    assert (loop.label, loop.start, loop.end) == (".L_x_1", 4, 16)
    body = sass.body(kernel, loop)
    assert body[0].opcode == "LDGSTS.E.BYPASS.128" and body[-1].opcode == "BRA"
    assert sass.memory(body) == {
        "LDG.E.U16": 1,
        "LDGSTS.E.BYPASS.128": 1,
        "LDSM.16.M88.4": 1,
        "LDS.U16": 1,
        "LDS.64": 1,
        "STS": 1,
    }
    # of two loops with as many HMMA, the inner one
    nested = EXCERPT.replace(
        "        /*0110*/                   BRA.DIV",
        "        /*0110*/              @P3 BRA `(.L_x_1) ;\n        /*0111*/  BRA.DIV",
    )
    (kernel,) = sass.kernels(sass.parse(nested))
    assert sass.main_loop(kernel).end == 16
    # an outer loop holding more HMMA than the loop inside it (a run of full tiles in a loop of its
    # own, the general body beside it): the inner loop
    outer = EXCERPT.replace(
        "        /*0120*/                   HMMA.16816.F32.BF16 R36, R14, R24, R36 ;",
        "        /*0120*/                   HMMA.16816.F32.BF16 R36, R14, R24, R36 ;\n"
        "        /*0121*/                   HMMA.16816.F32.BF16 R36, R14, R24, R36 ;\n"
        "        /*0122*/              @P4 BRA `(.L_x_0) ;",
    )
    outer = outer.replace(
        "        /*0030*/              @!PT LDS RZ, [RZ] ;",
        ".L_x_0:\n        /*0030*/  HMMA.16816.F32.BF16 R40, R14, R24, R40 ;",
    )
    (kernel,) = sass.kernels(sass.parse(outer))
    assert max(loop.hmma for loop in sass.loops(kernel)) == 6
    loop = sass.main_loop(kernel)
    assert (loop.label, loop.hmma) == (".L_x_1", 3)


def test_no_loop_without_hmma():
    text = EXCERPT.replace("HMMA.16816.F32.BF16", "FFMA")
    (kernel,) = sass.kernels(sass.parse(text))
    assert sass.main_loop(kernel) is None


def test_occupancy():
    sm90, sm80 = occupancy.LIMITS["sm_90"], occupancy.LIMITS["sm_80"]
    # 128 threads of 222 registers: 7168 a warp (7104 rounded to 256), 9 warps fit, two blocks of four
    assert occupancy.blocks_by_resource(222, 19460, 128, sm90) == {
        "registers": 2,
        "shared": 233472 // (19584 + 1024),
        "threads": 16,
        "blocks": 32,
    }
    assert occupancy.blocks_per_sm(222, 19460, 128, sm90) == (2, "registers")
    # 32 registers, 256 threads: 8 blocks by registers and by threads; 48 KB of shared (and the 1 KB
    # reserved): 4 on sm_90, 3 on sm_80
    assert occupancy.blocks_per_sm(32, 48 * 1024, 256, sm90) == (4, "shared")
    assert occupancy.blocks_per_sm(32, 48 * 1024, 256, sm80) == (3, "shared")
    assert occupancy.blocks_by_resource(64, 0, 256, sm90)["registers"] == 4
    # small blocks: the thread limit, then the block limit
    assert occupancy.blocks_per_sm(16, 0, 1024, sm90) == (2, "threads")
    assert occupancy.blocks_per_sm(16, 0, 32, sm90) == (32, "blocks")


def _missing() -> str | None:
    from benchmarks.kernel_report.assemble import toolchain_missing

    return toolchain_missing()


@pytest.mark.skipif(_missing() is not None, reason=f"kernel report toolchain: {_missing()}")
@pytest.mark.long
def test_report_of_the_bf16_causal_forward_at_d64():
    from benchmarks.kernel_report.cli import run
    from benchmarks.kernel_report.kernels import Case
    from benchmarks.kernel_report.report import detail, row

    split, report = run([Case("causal_any", "bf16", 64)], ["sm_90"])
    # the kernel that can split its keys, and the one a launch filling the GPU runs: no merge
    assert (split.label, report.label) == ("causal_any bf16 D=64 fwd", "causal_any bf16 D=64 fwd 1sp")
    assert report.kernel_counts.instructions < split.kernel_counts.instructions
    assert (report.loop.hmma, report.loop.memory) == (split.loop.hmma, split.loop.memory)  # the same main loop
    assert report.arch == "sm_90" and report.products == "bf16" and report.threads == 128  # 4 warps of 32 rows
    assert report.registers > 0 and report.blocks_per_sm >= 1
    assert report.kernel_counts.hmma > 0 and report.kernel_counts.instructions > report.kernel_counts.hmma
    assert report.loop is not None and report.loop.hmma > 0
    assert report.loop.instructions < report.kernel_counts.instructions
    # every global load an asynchronous copy: keys, values and the query
    loads = [op for op in report.kernel_counts.memory if op.startswith("LDG")]
    assert loads and all(op.startswith("LDGSTS") for op in loads)
    assert report.label in row(report) and "main loop" in detail(report)
    assert report.to_json()["kernel_counts"]["per_hmma"] > 1
