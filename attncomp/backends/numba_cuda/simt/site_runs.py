"""The sites' running sums of a backward kernel: what a gradient region adds into an argument's gradient.

A site is a tensor the gradient region adds contributions into at an index (ALiBi's ``slopes[h]``).
A thread keeps a run per site, a sum and the index it is for (``sacc_{k}``, ``sidx_{k}_{a}``), adds
its contributions to the run while they go to the same index (one index per thread block for
ALiBi), and adds the run into the site with one atomic when the index changes and at the end, not
one per element.  An index outside the site's shape is dropped (the forward's gather of the same
index reads it unchecked too).  The scalar and tensor-core backwards add runs with atomics; the
deterministic backward (``simt/deterministic_backward.py``) sums them in a fixed order instead.
"""

from __future__ import annotations


class SiteRuns:
    """The sites' runs of a backward writer (``BackwardKernelWriter``: its ``sites``, per site its
    rank and the names of its run's sum and index, and its source lines)."""

    sites: list[tuple[int, str, list[str]]]

    def start_sites(self) -> None:
        """Each site's running sum at zero, its index at none yet."""
        for _, acc, current in self.sites:
            self.w.line(f"{acc} = ACC(0.0)")
            for name in current:
                self.w.line(f"{name} = np.int64(-1)")

    def site_add(self, k: int, contribution: str, index: list[str]) -> None:
        """Add a site contribution to this thread's run for its index; a new index flushes the run."""
        w = self.w
        rank, acc, current = self.sites[k]
        if rank == 0:
            w.line(f"{acc} += ACC({contribution})")
            return
        inside = " and ".join(f"0 <= {x} < site_{k}.shape[{a}]" for a, x in enumerate(index))
        w.line(f"if {inside}:")
        with w.indent():
            self.site_run(k, index, f"ACC({contribution})")

    def site_run(self, k: int, index: list[str], value: str, as_index: str = "{}") -> None:
        """``value`` into site ``k``'s open run when ``index`` is the run's, else the run flushed
        (:meth:`site_flush`) and a new one opened at ``index`` (each written as ``as_index``)."""
        w = self.w
        rank, acc, current = self.sites[k]
        w.line(f"if {' and '.join(f'{x} == {c}' for x, c in zip(index, current))}:")
        with w.indent():
            w.line(f"{acc} += {value}")
        w.line("else:")
        with w.indent():
            self.site_flush(k)
            for x, c in zip(index, current):
                w.line(f"{c} = {as_index.format(x)}")
            w.line(f"{acc} = {value}")

    def site_flush(self, k: int) -> None:
        w = self.w
        rank, acc, current = self.sites[k]
        if rank == 0:
            w.line(f"cuda.atomic.add(site_{k}, 0, {acc})")
            return
        w.line(f"if {current[0]} >= 0:")
        with w.indent():
            at = current[0] if rank == 1 else f"({', '.join(current)})"  # numba wants a plain index in 1-d
            w.line(f"cuda.atomic.add(site_{k}, {at}, {acc})")

    def declare_site_arrays(self) -> None:
        """Shared arrays for the sites' sums: none here (each thread adds its runs with atomics)."""
