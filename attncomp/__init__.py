"""attncomp: a compiler for attention kernels written as math."""

from attncomp.api import CompiledFunction, compile, interpret, parse_ir
from attncomp.dsl import Spec, bf16, bool_, f8e4m3, f8e5m2, f16, f32, f64, floating, i32, i64, spec
from attncomp.errors import (
    AttncompError,
    IRParseError,
    PipelineError,
    ShapeError,
    SpecError,
    VerifyError,
)
from attncomp.functions import (
    abs,
    concat,
    cos,
    dropout,
    exp,
    index,
    inf,
    log,
    logsumexp,
    max,
    maximum,
    mean,
    min,
    minimum,
    page_view,
    random,
    repeat_kv,
    rsqrt,
    sigmoid,
    sin,
    softmax,
    sqrt,
    sum,
    tanh,
    where,
)
from attncomp.plot import plot_attention

__version__ = "0.1.0"

SPEC_FUNCTIONS = (
    "abs concat cos dropout exp index log logsumexp max maximum mean min minimum page_view random repeat_kv rsqrt "
    "sigmoid sin softmax sqrt sum tanh where"
).split()

__all__ = [
    "AttncompError",
    "CompiledFunction",
    "IRParseError",
    "PipelineError",
    "ShapeError",
    "Spec",
    "SpecError",
    "VerifyError",
    "abs",
    "bool_",
    "compile",
    "concat",
    "cos",
    "dropout",
    "exp",
    "bf16",
    "f8e4m3",
    "f8e5m2",
    "f16",
    "floating",
    "f32",
    "f64",
    "i32",
    "i64",
    "index",
    "inf",
    "interpret",
    "log",
    "logsumexp",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "page_view",
    "parse_ir",
    "plot_attention",
    "random",
    "repeat_kv",
    "rsqrt",
    "sigmoid",
    "sin",
    "softmax",
    "spec",
    "sqrt",
    "sum",
    "tanh",
    "where",
]


def __getattr__(name: str):
    raise AttributeError(f"attncomp has no name '{name}'; spec functions are: " + ", ".join(SPEC_FUNCTIONS))
