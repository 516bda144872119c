"""A kernel's Python function rewritten as a generator that yields where its thread would wait.

Numba's simulator runs each CUDA thread of a block as a Python thread, so that a thread can stop at
``cuda.syncthreads`` or a warp instruction (``mma/warp_sim.py``'s ``exchange``) and go on once the
others have come: every such stop is a switch between operating-system threads, some 15 us, and
the simulated kernels stop every few lines.  Here the same source is compiled once more with each
stop turned into a ``yield``, so that ``sim_lanes.py`` can run all the threads of a block as
generators in one thread, resuming each in turn (a resumption costs about a microsecond):

- ``cuda.syncthreads()`` becomes ``(yield ("syncthreads",))``, and ``cuda.syncthreads_count(v)``
  (``_and``, ``_or``) ``(yield ("syncthreads_count", v))``: the block's vote is what the yield gives;
- ``exchange(value, combine)`` becomes ``(yield ("exchange", value, combine))``: the warp's result
  and the lane, what ``exchange`` returns;
- a call of a function that stops (transitively: a device function, an emulated warp instruction, a
  helper of one) becomes ``(yield from _coop_(f)(...))``, with ``_coop_`` this module's
  :func:`resumable`, given to the rewritten function as a keyword-only default.

Everything else is the function's own code, line for line (its file and line numbers are kept, for
tracebacks and for the simulator, which tells a block's shared arrays apart by the line that
declares them), with its globals and closure.  A function that stops inside a lambda, a
comprehension or a nested function, or whose source cannot be read, cannot be rewritten:
:func:`resumable_kernel` gives None and the simulator's threads run it.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import textwrap
import types

#: the simulator's block votes, as their requests name them
VOTES = ("syncthreads_count", "syncthreads_and", "syncthreads_or")


class NotResumable(Exception):
    """A function this module cannot rewrite."""


def _exchange():
    from attncomp.backends.numba_cuda.mma import warp_sim

    return warp_sim.exchange


def _python_function(target):
    """The Python function a call target runs: a plain function, or a simulated device function's."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    if isinstance(target, FakeCUDAKernel):
        return target.fn
    if isinstance(target, types.FunctionType):
        return target
    return None


def _is_cuda(value) -> bool:
    from numba import cuda
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    return value is cuda or isinstance(value, FakeCUDAModule)


class _Scope:
    """What a function's names refer to: its closure, then its globals, then the builtins."""

    def __init__(self, function: types.FunctionType):
        cells = function.__closure__ or ()
        self.free = dict(zip(function.__code__.co_freevars, cells))
        self.globals = function.__globals__

    def value(self, node: ast.expr):
        """The object a name or a chain of attributes of one refers to; ``_MISSING`` otherwise."""
        if isinstance(node, ast.Name):
            if node.id in self.free:
                try:
                    return self.free[node.id].cell_contents
                except ValueError:
                    return _MISSING
            if node.id in self.globals:
                return self.globals[node.id]
            return getattr(builtins, node.id, _MISSING)
        if isinstance(node, ast.Attribute):
            base = self.value(node.value)
            if isinstance(base, types.ModuleType) or _is_cuda(base):
                return getattr(base, node.attr, _MISSING)
        return _MISSING


_MISSING = object()
#: packages whose functions never stop at a barrier (not read)
_LIBRARIES = {"numpy", "numba", "numba_cuda", "ml_dtypes", "math", "builtins"}


def _stop(scope: _Scope, call: ast.Call) -> tuple[str | None, types.FunctionType | None]:
    """What kind of stop a call is: a barrier or vote (its name), ``"exchange"``, ``"call"`` (of a
    function that stops, given with it), or None."""
    func = call.func
    if isinstance(func, ast.Attribute) and _is_cuda(scope.value(func.value)):
        return (func.attr if func.attr == "syncthreads" or func.attr in VOTES else None), None
    target = scope.value(func)
    if target is _MISSING:
        return None, None
    if target is _exchange():
        return "exchange", None
    function = _python_function(target)
    if function is not None and (function.__module__ or "").partition(".")[0] not in _LIBRARIES and stops(function):
        return "call", function
    return None, None


class _Rewrite(ast.NodeTransformer):
    """Turns the stops of one function's body into yields (see the module's docstring)."""

    def __init__(self, scope: _Scope):
        self.scope = scope
        self.rewritten = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        kind, callee = _stop(self.scope, node)
        if kind is None:
            return node
        self.rewritten += 1
        if kind == "call":
            _rewritten_once(callee)  # if it cannot be rewritten, neither can this function
            resumed = ast.Call(ast.Name("_coop_", ast.Load()), [node.func], [])
            return _located(ast.YieldFrom(ast.Call(resumed, node.args, node.keywords)), node)
        if node.keywords or (kind == "exchange" and len(node.args) != 2):
            raise NotResumable(f"a {kind} call with keywords or other arguments at line {node.lineno}")
        request = ast.Tuple([ast.Constant(kind), *node.args], ast.Load())
        return _located(ast.Yield(request), node)

    def _nested(self, node: ast.AST) -> ast.AST:
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and _stop(self.scope, inner)[0] is not None:
                raise NotResumable(f"a stop inside a nested scope at line {inner.lineno}")
        return node

    visit_Lambda = visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _nested
    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _nested


def _definition(function: types.FunctionType) -> ast.FunctionDef:
    """``function``'s definition, parsed from its lines in its file (a new tree each call, at the
    file's line numbers): from its ``def`` to the next line indented no deeper."""
    code = function.__code__
    lines = linecache.getlines(code.co_filename)
    first = code.co_firstlineno - 1  # its first decorator's line, or the def's
    while first < len(lines) and not lines[first].lstrip().startswith("def "):
        first += 1
    if first == len(lines):
        raise NotResumable(f"no source for {function.__qualname__} in {code.co_filename}")
    indent = len(lines[first]) - len(lines[first].lstrip())
    end = first + 1
    while end < len(lines):
        text = lines[end].strip()
        if text and not text.startswith("#") and len(lines[end]) - len(lines[end].lstrip()) <= indent:
            break
        end += 1
    tree = ast.parse("\n" * first + textwrap.dedent("".join(lines[first:end])))
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef) or definition.name != function.__name__:
        raise NotResumable(f"no definition of {function.__qualname__} at line {first + 1}")
    return definition


def _located(node: ast.AST, like: ast.AST) -> ast.AST:
    """``node`` with ``like``'s place in the source given to each of its nodes that has none."""
    for new in ast.walk(node):
        if "lineno" in new._attributes and not hasattr(new, "lineno"):
            ast.copy_location(new, like)
    return node


_STOPS: dict = {}  # function -> whether it stops
_RESUMABLE: dict = {}  # function -> its generator (or the function, where it never stops)


def stops(function: types.FunctionType) -> bool:
    """Whether calling ``function`` may stop at a barrier or a warp instruction (read from its
    source and its callees'); True for one whose source cannot be read."""
    known = _STOPS.get(function)
    if known is not None:
        return known
    _STOPS[function] = False  # a recursive call stops only if something else in it does
    try:
        definition = _definition(function)
    except (NotResumable, SyntaxError):
        _STOPS[function] = True
        return True
    scope = _Scope(function)
    found = any(isinstance(node, ast.Call) and _stop(scope, node)[0] for node in ast.walk(definition))
    _STOPS[function] = found
    return found


def _compiled(function: types.FunctionType, definition: ast.FunctionDef) -> types.FunctionType:
    """The rewritten definition as a function with ``function``'s globals, closure and defaults."""
    definition.decorator_list = []
    definition.args.kwonlyargs.append(_located(ast.arg("_coop_"), definition))
    definition.args.kw_defaults.append(_located(ast.Constant(None), definition))
    free = function.__code__.co_freevars
    body: ast.stmt = definition
    if free:  # compiled inside a function that defines the free names, so they stay free
        assigned = [ast.Assign([ast.Name(name, ast.Store())], ast.Constant(None)) for name in free]
        outer = ast.FunctionDef("_outer", ast.arguments([], [], None, [], [], None, []), [*assigned, definition], [])
        body = _located(outer, definition)
    code = compile(ast.Module([body], []), function.__code__.co_filename, "exec")
    if free:
        code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "_outer")
    code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == function.__name__)
    cells = dict(zip(free, function.__closure__ or ()))
    closure = tuple(cells[name] for name in code.co_freevars) or None
    rewritten = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__, closure)
    rewritten.__kwdefaults__ = {**(function.__kwdefaults__ or {}), "_coop_": resumable}
    return rewritten


def _rewritten(function: types.FunctionType) -> types.FunctionType:
    definition = _definition(function)
    rewrite = _Rewrite(_Scope(function))
    definition.body = [rewrite.visit(statement) for statement in definition.body]
    if not rewrite.rewritten:
        return function
    return _compiled(function, definition)


def _rewritten_once(function: types.FunctionType) -> types.FunctionType:
    generator = _RESUMABLE.get(function)
    if generator is None:
        generator = _RESUMABLE[function] = _rewritten(function)
    return generator


def resumable(target):
    """The generator function that runs ``target`` (a function or a simulated device function),
    stopping where it would wait; what a rewritten call site resumes with ``yield from``."""
    found = _CALLABLES.get(target)
    if found is None:
        found = _CALLABLES[target] = _resumed(target)
    return found


_CALLABLES: dict = {}  # call target -> what ``resumable`` gives for it


def _resumed(target):
    from numba.cuda.simulator.kernel import FakeCUDAKernel, _get_kernel_context
    from numba.cuda.simulator.kernelapi import swapped_cuda_module

    function = _python_function(target)
    generator = _rewritten_once(function)
    if not inspect.isgeneratorfunction(generator):  # a callee that no longer stops (a test's stand-in)
        return _at_once(generator)
    if isinstance(target, FakeCUDAKernel):  # its module's ``cuda`` is the launch's while it runs

        def device(*args, **kwargs):
            with swapped_cuda_module(function, _get_kernel_context()):
                return (yield from generator(*args, **kwargs))

        return device
    return generator


def _at_once(function):
    def run(*args, **kwargs):
        return function(*args, **kwargs)
        yield  # a generator that never stops

    return run


def resumable_kernel(function: types.FunctionType):
    """``function`` (a kernel's) as a generator function, ``function`` itself where it never
    stops, or None where it cannot be rewritten."""
    try:
        return _rewritten_once(function)
    except (NotResumable, SyntaxError):
        return None
