"""One kernel's figures for one target: resources, occupancy, instructions and memory operations,
over the whole kernel and in its main loop; and how they are printed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from benchmarks.kernel_report import assemble, occupancy, sass
from benchmarks.kernel_report.kernels import Built


@dataclass
class Counts:
    instructions: int
    hmma: int
    memory: dict[str, int]  # by opcode: {"LDG.E.U16": 12, ...}

    @property
    def per_hmma(self) -> float | None:
        return self.instructions / self.hmma if self.hmma else None


@dataclass
class KernelReport:
    label: str  # the case: spec, dtype, head dim, direction
    kernel: str  # the kernel's name
    arch: str  # "sm_90"
    products: str  # tensor-core products' type, or "scalar"
    threads: int
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared: int  # static shared memory, bytes
    blocks_per_sm: int
    limited_by: str  # the resource that limits blocks per SM
    kernel_counts: Counts
    loop: Counts | None  # the main loop's, None without one
    loop_label: str | None = None
    nested_loops: list[int] = field(default_factory=list)  # instructions of each loop inside the main loop
    subroutines: dict[str, int] = field(default_factory=dict)  # instructions of each called function

    def to_json(self) -> dict:
        found = asdict(self)
        found["kernel_counts"]["per_hmma"] = self.kernel_counts.per_hmma
        found["widths"] = {opcode: sass.width(opcode) for opcode in self.kernel_counts.memory}  # bits a thread
        if self.loop is not None:
            found["loop"]["per_hmma"] = self.loop.per_hmma
        return found


def _counts(instructions: list[sass.Instruction]) -> Counts:
    return Counts(len(instructions), sass.count(instructions, "HMMA"), sass.memory(instructions))


def measure(built: Built, ptx: str, cc: tuple[int, int]) -> KernelReport:
    """Assemble one kernel's PTX for ``sm_XY`` and count its SASS."""
    from attncomp.backends.numba_cuda.ptx import ptxas_report

    arch = f"sm_{cc[0]}{cc[1]}"
    resources = ptxas_report(ptx, cc)
    shared = assemble.shared_bytes(resources.log)
    functions = sass.parse(assemble.disassemble(assemble.link_cubin(ptx, cc)))
    entries = sass.kernels(functions)
    if len(entries) != 1:
        raise RuntimeError(f"{built.kernel.name}: {len(entries)} entry functions in the cubin")
    (function,) = entries
    blocks, limiter = occupancy.blocks_per_sm(resources.registers, shared, built.threads, occupancy.LIMITS[arch])
    loop = sass.main_loop(function)
    nested = []
    if loop is not None:
        nested = [
            inner.instructions
            for inner in sass.loops(function)
            if loop.start <= inner.start and inner.end < loop.end and inner != loop
        ]
    return KernelReport(
        label=built.label,
        kernel=built.kernel.name,
        arch=arch,
        products=built.products,
        threads=built.threads,
        registers=resources.registers,
        spill_stores=resources.spill_store_bytes,
        spill_loads=resources.spill_load_bytes,
        shared=shared,
        blocks_per_sm=blocks,
        limited_by=limiter,
        kernel_counts=_counts(function.instructions),
        loop=None if loop is None else _counts(sass.body(function, loop)),
        loop_label=None if loop is None else loop.label,
        nested_loops=nested,
        subroutines={f.name: len(f.instructions) for f in functions if not f.entry},
    )


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _kinds(memory: dict[str, int], prefixes: tuple[str, ...]) -> str:
    """``LDG.E.U16x12 STSx9``: the opcodes of these mnemonics, with their counts."""
    found = [f"{op}x{n}" for op, n in memory.items() if op.split(".", 1)[0] in prefixes]
    return " ".join(found) or "-"


HEADER = (
    f"{'kernel':30s} {'arch':5s} {'mma':6s} {'thr':>4s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'blk/SM':>6s} "
    f"{'instr':>6s} {'HMMA':>5s} {'i/HMMA':>6s} {'loop':>5s} {'loopHMMA':>8s} {'i/HMMA':>6s}"
)


def row(report: KernelReport) -> str:
    """One line of the table."""
    k, loop = report.kernel_counts, report.loop
    spills = report.spill_stores + report.spill_loads
    in_loop = (loop.instructions, loop.hmma, loop.per_hmma) if loop else (0, 0, None)
    return (
        f"{report.label:30s} {report.arch:5s} {report.products:6s} {report.threads:4d} {report.registers:4d} "
        f"{spills:5d} {report.shared:6d} {report.blocks_per_sm:2d} {report.limited_by[:3]:3s} "
        f"{k.instructions:6d} {k.hmma:5d} {_ratio(k.per_hmma):>6s} "
        f"{in_loop[0]:5d} {in_loop[1]:8d} {_ratio(in_loop[2]):>6s}"
    )


def detail(report: KernelReport) -> str:
    """The lines printed under a kernel's heading."""
    k, loop = report.kernel_counts, report.loop
    lines = [
        f"{report.label} [{report.arch}]  {report.kernel}",
        f"  {report.products} products, {report.threads} threads, {report.registers} registers, "
        f"spill stores/loads {report.spill_stores}/{report.spill_loads} bytes, {report.shared} bytes static shared, "
        f"{report.blocks_per_sm} blocks/SM (limited by {report.limited_by})",
        f"  kernel: {k.instructions} instructions, {k.hmma} HMMA, {_ratio(k.per_hmma)} per HMMA",
    ]
    if loop is None:
        lines.append("  main loop: none (no loop holds an HMMA)")
    else:
        nested = f", {len(report.nested_loops)} nested loop(s) of {report.nested_loops} instructions counted once"
        lines.append(
            f"  main loop ({report.loop_label}): {loop.instructions} instructions, {loop.hmma} HMMA, "
            f"{_ratio(loop.per_hmma)} per HMMA{nested if report.nested_loops else ''}"
        )
    lines.append(f"  {'memory op':24s} {'bits':>4s} {'kernel':>6s} {'loop':>6s}")
    for opcode, n in k.memory.items():
        in_loop = loop.memory.get(opcode, 0) if loop else 0
        lines.append(f"  {opcode:24s} {sass.width(opcode):4d} {n:6d} {in_loop:6d}")
    if report.subroutines:
        called = ", ".join(f"{name} ({n})" for name, n in report.subroutines.items())
        lines.append(f"  subroutines (not counted above): {called}")
    return "\n".join(lines)


def summary(reports: list[KernelReport]) -> str | None:
    """One line of the bf16 causal forward figures at D = 64 and 128 (sm_90), when both were measured:
    of the kernel without key splits where there is one (the one a long prefill runs)."""
    parts = []
    for d in (64, 128):
        label = f"causal_any bf16 D={d} fwd"
        found = [r for r in reports if r.label == f"{label} 1sp" and r.arch == "sm_90"]
        found = found or [r for r in reports if r.label == label and r.arch == "sm_90"]
        if not found:
            return None
        r = found[0]
        loop_memory = r.loop.memory if r.loop else {}
        loads = _kinds(loop_memory, ("LDG", "LDGSTS", "STS", "LDSM", "LDS"))
        absent = [m for m in ("LDGSTS", "LDSM") if not any(op.split(".", 1)[0] == m for op in loop_memory)]
        loads += "".join(f", no {m}" for m in absent)
        which = " (one split)" if r.label.endswith("1sp") else ""
        parts.append(
            f"D={d}{which}: {_ratio(r.kernel_counts.per_hmma)} instr/HMMA kernel, "
            f"{_ratio(r.loop.per_hmma if r.loop else None)} main loop, loop loads {loads}"
        )
    return "bf16 causal forward, sm_90 (offline SASS counts): " + "; ".join(parts)
