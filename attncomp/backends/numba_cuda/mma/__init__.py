"""The tensor-core attention kernels (``mma.sync``): the atom table (``atoms.py``), the forward
(``forward_kernel.py``, its asynchronous-copy variant ``flash_kernel.py``, float32 as 3xTF32
``tf32_kernel.py``), the backward (``backward_kernel.py``, ``tf32_backward_kernel.py``), their
plans (``forward_plan.py``, ``backward_plan.py``), and the warp instructions they call, as PTX
(``warp_ptx.py``) and as the simulator's emulation (``warp_sim.py``, ``warp_sim_copies.py``)."""
