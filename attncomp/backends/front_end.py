"""What attncomp changes in Numba's front end while it compiles its kernels, installed in one call.

Numba's CPU compiler (``numba.core``) and numba-cuda's copy of it (``numba.cuda.core``) run the
same passes; for each, :func:`install` gives the analysis module the work-list live variables
(``live_variables.py``), the post-processor its lifetimes on demand (``lazy_lifetimes.py``), the
SSA module its one-pass reconstruction (``ssa_fix.py``), the closure inliner a pass over
functions it can find nothing in (``closure_inlining.py``) and the error messages their markup
without colorama's stream set-up (``markup.py``; the cuda front end's and Numba's own, through
which numba-cuda builds some of its messages); and the cpu code generator leaves its LLVM passes
per function to the module's (``function_passes.py``).  Installing one front end never
imports the other's compiler (a cpu call imports no CUDA compiler).  Each change is idempotent
and, where it could touch a user's own Numba code, active only inside attncomp's compile window
(``compile_window.window``, which installs them; ``call_types.compiling`` says whether a thread
is inside it).
"""

from __future__ import annotations

from attncomp.backends import closure_inlining, function_passes, lazy_lifetimes, live_variables, markup, ssa_fix

#: the package of each target's Numba front end
PACKAGES = {"cpu": "numba.core", "cuda": "numba.cuda.core"}


def install(target: str) -> None:
    """Install the changes in the front end of ``target`` (a key of :data:`PACKAGES`)."""
    package = PACKAGES[target]
    live_variables.install(f"{package}.analysis")
    lazy_lifetimes.install(f"{package}.postproc")
    ssa_fix.install(f"{package}.ssa")
    closure_inlining.install(f"{package}.untyped_passes")
    markup.install(f"{package}.errors")
    if target == "cpu":
        function_passes.install()  # Numba's LLVM passes per function left to the module's
    if target == "cuda":
        # numba-cuda types a kernel partly through Numba's own core (``typeof``, its error classes),
        # whose messages Numba's errors module marks up: 17,000 of a few CUDA kernels' pieces
        markup.install("numba.core.errors")
