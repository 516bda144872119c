"""The known cards and their datasheet peaks, which the timings are held against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Card:
    """Datasheet peaks of one card (dense, no sparsity): TFLOP/s of f16/bf16, tf32 and float32 FMA
    products, and memory bandwidth in GB/s."""

    name: str
    half: float
    tf32: float
    f32: float
    bandwidth: float

    def tflops_peak(self, dtype: str, precision: str | None) -> float:
        """The peak of the products a row runs: f16/bf16 tensor cores, tf32 ones (float32 rows but
        ``precision=ieee``), or float32 FMAs."""
        if dtype in ("bfloat16", "float16"):
            return self.half
        return self.f32 if precision == "ieee" else self.tf32


#: (what the device name contains, what it must not, the card): the first match wins
CARDS = (
    (("H200",), (), Card("H200", 989.4, 494.7, 66.9, 4800.0)),
    (("H100", "PCIE"), (), Card("H100 PCIe", 756.5, 378.0, 51.2, 2039.0)),
    (("H100",), ("NVL",), Card("H100 SXM", 989.4, 494.7, 66.9, 3352.0)),
    (("A100", "PCIE", "40GB"), (), Card("A100 PCIe 40GB", 312.0, 156.0, 19.5, 1555.0)),
    (("A100", "PCIE"), (), Card("A100 PCIe 80GB", 312.0, 156.0, 19.5, 1935.0)),
    (("A100", "40GB"), (), Card("A100 SXM 40GB", 312.0, 156.0, 19.5, 1555.0)),
    (("A100",), (), Card("A100 SXM 80GB", 312.0, 156.0, 19.5, 2039.0)),
)


def card_for(device_name: str | None) -> Card | None:
    """The known card a device name is (``torch.cuda.get_device_name()``, ``nvidia-smi``'s name), or
    None: an unknown card."""
    name = (device_name or "").upper()
    for wanted, unwanted, card in CARDS:
        if all(w in name for w in wanted) and not any(u in name for u in unwanted):
            return card
    return None
