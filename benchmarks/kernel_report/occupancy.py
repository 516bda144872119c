"""Blocks per multiprocessor from a kernel's registers, shared memory and block size.

Each resource limits the resident blocks; the fewest wins.  Registers are allocated per warp in
units of 256 (a thread's count times 32, rounded up); each block's shared memory is rounded up to
128 bytes and the runtime reserves 1 KB more per block.
"""

from __future__ import annotations

from dataclasses import dataclass

WARP = 32


@dataclass(frozen=True)
class Limits:
    registers: int  # 32-bit registers per multiprocessor
    shared: int  # bytes of shared memory per multiprocessor
    threads: int  # resident threads per multiprocessor
    blocks: int  # resident blocks per multiprocessor
    register_unit: int = 256  # registers per warp are allocated in these
    shared_unit: int = 128  # bytes
    shared_reserved: int = 1024  # bytes the runtime keeps per block


#: by target (``sm_XY``)
LIMITS = {
    "sm_80": Limits(registers=65536, shared=164 * 1024, threads=2048, blocks=32),
    "sm_90": Limits(registers=65536, shared=228 * 1024, threads=2048, blocks=32),
}


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def blocks_by_resource(registers: int, shared: int, threads: int, limits: Limits) -> dict[str, int]:
    """Resident blocks each resource allows: ``registers`` per thread, ``shared`` bytes per block,
    ``threads`` per block."""
    warps = -(-threads // WARP)
    per_warp = _round_up(max(registers, 1) * WARP, limits.register_unit)
    per_block = _round_up(shared, limits.shared_unit) + limits.shared_reserved
    return {
        "registers": (limits.registers // per_warp) // warps,
        "shared": limits.shared // per_block,
        "threads": limits.threads // threads,
        "blocks": limits.blocks,
    }


def blocks_per_sm(registers: int, shared: int, threads: int, limits: Limits) -> tuple[int, str]:
    """Resident blocks per multiprocessor, and the resource that limits them."""
    found = blocks_by_resource(registers, shared, threads, limits)
    limiter = min(found, key=found.__getitem__)
    return found[limiter], limiter
