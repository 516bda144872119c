"""The verdict and ``summary.md``: the verdict, the card and a line per phase first, then the tables
(rates against the card's peaks) and the environment."""

from __future__ import annotations

import datetime
import re
import time

from benchmarks.gpu_check.cards import Card, card_for
from benchmarks.gpu_check.plan import FILES
from benchmarks.gpu_check.run import Run

#: failed tests named in the summary (correctness.tsv lists every one)
FAILED_LISTED = 40


#: the module each timing table without a title of its own comes from (the rest: ``benchmarks.gpu``)
TABLE_SOURCES = {"flex": "benchmarks.flex", "flash_attn": "benchmarks.flash_attn", "serving": "benchmarks.serving"}


def verdict(run: Run) -> str:
    states = [p.status for p in run.phases.values()]
    if not run.args.dry_run and run.phases["environment"].data.get("gpu_reason"):
        return "NO GPU"
    word = "FAILED" if "failed" in states else "INCOMPLETE" if "timed out" in states else "PASSED"
    return f"DRY RUN {word}" if run.args.dry_run else word


def card_line(run: Run) -> tuple[str, Card | None]:
    info = run.phases["environment"].data
    if run.args.dry_run:
        return "card: none (dry run: Numba's CUDA simulator)", None
    name = info.get("gpu_name")
    if not name:
        return f"card: none ({info.get('gpu_reason', 'unknown')})", None
    card = card_for(name)
    known = f"{card.name}" if card else "unknown card"
    details = ", ".join(
        filter(
            None,
            [
                f"compute capability {info['compute_capability']}" if info.get("compute_capability") else "",
                f"driver {info['driver']}" if info.get("driver") else "",
                f"CUDA driver API {info['cuda_driver']}" if info.get("cuda_driver") else "",
            ],
        )
    )
    return f"card: {name} ({known}){': ' + details if details else ''}", card


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "card"


def suggested_results_path(run: Run, card: Card | None) -> str:
    name = card.name if card else run.phases["environment"].data.get("gpu_name") or "unknown"
    return f"benchmarks/results/{slug(name)}-{datetime.date.today().isoformat()}.md"


def percent(value: float, peak: float | None) -> str:
    return f"{100 * value / peak:.0f}%" if peak else "n/a"


def table_lines(title: str, records: list[dict], card: Card | None) -> list[str]:
    lines = [
        f"### {title}",
        "",
        "| case | ours ms | TFLOP/s | of peak | GB/s | of peak | peer | peer ms | ratio | SDPA default | ms | ratio "
        "| kernel |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("kind") == "error":
            lines.append(f"| {r['name']} | error: {r['error']} |")
            continue
        if r.get("kind") != "row":
            continue
        peak = card.tflops_peak(r["dtype"], r.get("precision")) if card else None
        tflops, gbps = r["flops"] / (r["ms"] * 1e-3) / 1e12, r["bytes"] / (r["ms"] * 1e-3) / 1e9
        lines.append(
            f"| {r['name']} | {r['ms']:.3f} | {tflops:.1f} | {percent(tflops, peak)} | {gbps:.0f} | "
            f"{percent(gbps, card.bandwidth if card else None)} | {r['peer']} | {r['peer_ms']:.3f} | "
            f"{r['ratio']:.2f} | {r['default']} | {r['default_ms']:.3f} | {r['default_ratio']:.2f} | "
            f"{r.get('kernel') or '-'} |"
        )
    return lines + [""]


def bandwidth_note(text: str, card: Card | None) -> str:
    """`` (N% of the card's peak bandwidth)`` after a line reporting GB/s, where the card is known."""
    found = re.search(r"([\d.]+) GB/s", text)
    if card is None or found is None:
        return ""
    return f"  [{percent(float(found.group(1)), card.bandwidth)} of the {card.name}'s {card.bandwidth:g} GB/s]"


def timing_lines(run: Run, card: Card | None) -> list[str]:
    """The timings' section: the tensor-core tables, then the decoder's and serving's lines."""
    timings = run.phases["timings"]
    tables = timings.data.get("tables", {}) if timings.status != "skipped" else {}
    if not tables:
        return []
    lines = ["", "## Timings", ""]
    if card:
        lines.append(
            f"Peaks of the {card.name} (datasheet, dense): {card.half:g} TFLOP/s f16/bf16, {card.tf32:g} tf32, "
            f"{card.f32:g} float32; {card.bandwidth:g} GB/s. GB/s count each array of the call read or "
            "written once (the forward: q, k, v and the output; a training step: twelve such arrays)."
        )
        lines.append("")
    titles = {
        "tensor_cores": "Forward on tensor cores (benchmarks.tensor_cores)",
        "training": "Forward+backward on tensor cores (benchmarks.tensor_core_training)",
    }
    for name, table in tables.items():
        records = table.get("records", [])
        if table["status"] == "skipped":
            lines += [f"### {name}: skipped ({table.get('reason')})", ""]
            continue
        if name in titles:
            lines += table_lines(titles[name], records, card)
        else:
            source = TABLE_SOURCES.get(name, "benchmarks.gpu")
            lines += [f"### {name} ({source})", "", "```"]
            for r in records:
                if r.get("kind") == "line":
                    lines.append(r["text"] + bandwidth_note(r["text"], card))
                elif r.get("kind") == "profile":  # where a row's time goes (``benchmarks/host_profile.py``)
                    lines.append("  " + r["text"])
                elif r.get("kind") == "error":
                    lines.append(f"error: {r['error']}")
            lines += ["```", ""]
        if table["status"] != "passed":
            lines += [f"({name}: {table['status']}; timings.log has the output)", ""]
    return lines


def environment_lines(run: Run) -> list[str]:
    env = run.phases["environment"].data
    if not env:
        return []
    lines = ["", "## Environment", ""]
    for key in ("python", "platform", "cpus", "gpu_name", "compute_capability", "driver", "torch_cuda"):
        if env.get(key) not in (None, ""):
            lines.append(f"- {key}: {env[key]}")
    versions = env.get("versions", {})
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    if env.get("missing"):
        lines.append(f"- missing: {', '.join(env['missing'])}")
    if env.get("too_old"):
        lines.append(f"- older than pyproject.toml's minimums: {', '.join(env['too_old'])}")
    return lines


def summary(run: Run) -> str:
    card_text, card = card_line(run)
    total = time.monotonic() - run.start
    lines = [f"# gpu_check: {verdict(run)}", "", card_text, ""]
    for phase in run.phases.values():
        lines.append(
            f"- {phase.name}: {phase.status}, {phase.seconds:.0f} s" + (f": {phase.note}" if phase.note else "")
        )
    failed = run.phases["correctness"].data.get("failed", [])
    if failed:
        lines += ["", f"Failed in the correctness phase ({len(failed)}; correctness.log has each report):", ""]
        lines += [f"- `{node}`" for node in failed[:FAILED_LISTED]]
        if len(failed) > FAILED_LISTED:
            lines.append(f"- and {len(failed) - FAILED_LISTED} more (correctness.tsv)")
    slowest = run.phases["correctness"].data.get("slowest", [])
    if slowest:
        test_seconds = run.phases["correctness"].data.get("seconds", 0.0)
        lines += [
            "",
            f"Slowest in the correctness phase (seconds of each test's call; {test_seconds:.0f} s over every test that "
            "ran, summed across processes):",
            "",
        ]
        lines += [f"- {seconds:.1f} s `{node}`" for node, seconds in slowest]
    lines += ["", f"Total {total:.0f} s of a {run.args.deadline:.0f} s deadline; processes at a time: {run.jobs}."]
    if card is None and not run.args.dry_run and run.phases["environment"].data.get("gpu_name"):
        lines.append("Unknown card: no datasheet peaks, so no percentages of peak.")
    if run.phases["timings"].status in ("passed", "failed", "timed out"):
        lines += [
            "",
            f"Keep this summary as `{suggested_results_path(run, card)}`: the README's GPU figures come only "
            "from such files.",
        ]
    lines += timing_lines(run, card)
    lines += environment_lines(run)
    lines += ["", "Files: " + ", ".join(name for name in FILES if (run.out / name).exists() or name == "summary.md")]
    return "\n".join(lines) + "\n"
