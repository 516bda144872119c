"""The scalar FMA attention kernels (SIMT: one thread a few lanes of a row, products in registers):
the forward (``forward_kernel.py``), the backward with atomics (``backward_kernel.py``), the
deterministic backward and its dQ pass (``deterministic_backward.py``, ``dq_kernel.py``), each with
the plan of its thread block (``*_plan.py``), and the sites' running sums the backwards share
(``site_runs.py``)."""
