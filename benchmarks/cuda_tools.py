"""Finding a CUDA tool's binary (``compute-sanitizer``, ``nvdisasm``) where CUDA installs put it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def in_wheels(name: str) -> str | None:
    """``name`` in an installed nvidia wheel (``nvidia/**/bin/name`` or ``nvidia/**/name/name``)."""
    for entry in sys.path:
        nvidia = Path(entry or ".") / "nvidia"
        if nvidia.is_dir():
            for candidate in sorted(nvidia.glob(f"**/{name}")):
                if _executable(candidate) and candidate.parent.name in ("bin", name):
                    return str(candidate)
    return None


def in_toolkits(name: str) -> str | None:
    """``name`` on PATH, or under ``$CUDA_HOME``, ``$CUDA_PATH`` or ``/usr/local/cuda*``."""
    found = shutil.which(name)
    if found:
        return found
    places = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    places += sorted(str(p) for p in Path("/usr/local").glob("cuda-*"))
    for place in filter(None, places):
        for candidate in (Path(place) / "bin" / name, Path(place) / name / name):
            if _executable(candidate):
                return str(candidate)
    return None


def find_cuda_tool(name: str, wheels_first: bool = False) -> str | None:
    """The path of CUDA tool ``name``: in a toolkit (PATH, ``$CUDA_HOME``, ``/usr/local/cuda*``) or
    an nvidia wheel, the wheel first where ``wheels_first`` (a tool that must match the wheels'
    nvJitLink), else None."""
    order = (in_wheels, in_toolkits) if wheels_first else (in_toolkits, in_wheels)
    for find in order:
        found = find(name)
        if found:
            return found
    return None
