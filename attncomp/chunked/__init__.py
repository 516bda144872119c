"""Compiled attention over Dask arrays: a graph of chunk-pair kernel calls (docs/api.md section 8).

Dask is optional (the ``dask`` extra) and imported only when a Dask array
reaches a compiled function; ``import attncomp`` never imports it.
"""

from attncomp.chunked.graph import PAIR, is_dask, run_chunked

__all__ = ["PAIR", "is_dask", "run_chunked"]
