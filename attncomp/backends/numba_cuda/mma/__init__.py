"""The tensor-core attention kernels (``mma.sync``): the atom table (``atoms.py``), the operand
types (``operands.py``: 16-bit pairs, float32 as TF32 or 3xTF32), the forward (``forward_kernel.py``
with ``fragment_rows.py``, its asynchronous-copy variant ``flash_kernel.py``), the backward
(``backward_kernel.py`` with ``backward_staging.py`` and ``backward_elements.py``), their
plans (``forward_plan.py``, ``backward_plan.py``), and the warp instructions they call, as PTX
(``warp_ptx.py``) and as the simulator's emulation (``warp_sim.py``, ``warp_sim_copies.py``)."""
