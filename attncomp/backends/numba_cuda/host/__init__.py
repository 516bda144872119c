"""The host side of the CUDA backend: the generated driver (``driver.py``), the kernels of the ops
outside tiled attention (``graph_kernels.py``), device memory (``arrays.py``), launches and streams
(``launches.py``), argument binding (``arguments.py``) and a paged decoder's pool (``pages.py``)."""
