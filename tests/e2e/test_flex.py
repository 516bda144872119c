"""``attncomp.flex``: FlexAttention's calls (``score_mod``, ``block_mask``, GQA, the log-sum-exp) against
PyTorch's own ``flex_attention`` (forward: PyTorch runs no FlexAttention backward on the CPU) and the
gradients against the same attention written densely in torch, a learned bias included."""

import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import attncomp.flex as acf  # noqa: E402
from tests.conftest import TORCH_COMPILE  # noqa: E402

#: PyTorch's eager FlexAttention says it is not compiled, and that return_lse is deprecated
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without:UserWarning", "ignore:return_lse")

B, H, KV, L, D = 2, 4, 2, 40, 16
WINDOW = 9


def tensors(seed: int = 0, heads: int = H, grad: bool = False):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, heads, L, D), (B, KV, L, D), (B, KV, L, D))
    return [torch.randn(*s, generator=generator).requires_grad_(grad) for s in shapes]


SLOPES = torch.linspace(0.5, 0.05, H)
DOC = torch.tensor([0] * 13 + [1] * 20 + [2] * 7)  # three packed documents


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def documents(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx)


def near(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= WINDOW


def softcap(score, b, h, q_idx, kv_idx):
    return 8 * torch.tanh(score / 8)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx).float()


PREFIX = torch.tensor([6, 25])  # each row's prefix, seen by every query
IMAGE = 8  # 40 positions: a 5 x 8 image


def neighbours(b, h, q_idx, kv_idx):
    """A 3 x 3 neighbourhood on the image (NATTEN's pattern): rows and columns by // and %."""
    rows, columns = (q_idx // IMAGE - kv_idx // IMAGE).abs(), (q_idx % IMAGE - kv_idx % IMAGE).abs()
    return (rows <= 1) & (columns <= 1)


def prefix(b, h, q_idx, kv_idx):
    return kv_idx < PREFIX[b]


def clamped(score, b, h, q_idx, kv_idx):
    return score + 0.1 * torch.clamp(q_idx - kv_idx, min=0, max=4).float() - torch.sigmoid(score)


CASES = {
    "softcap-documents": (softcap, documents),
    "alibi-window-two-sided": (alibi, flex.and_masks(near, causal)),
    "alibi-no-mask": (alibi, None),
    "neighbourhood-2d": (None, neighbours),
    "clamp-sigmoid-prefix-lm": (clamped, flex.or_masks(prefix, causal)),
}


def dense(q, k, v, score_mod, mask_mod, scale=D**-0.5):
    """The same attention in torch, every score computed: the modifications called on index grids."""
    sizes = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    b, h, i, j = (torch.arange(n).reshape([-1 if a == d else 1 for a in range(4)]) for d, n in enumerate(sizes))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    s = (q @ k.mT) * scale
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = torch.where(mask_mod(b, h, i, j), s, -torch.inf)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_lse_match_pytorchs_flex_attention(case):
    score_mod, mask_mod = CASES[case]
    q, k, v = tensors()
    ours = acf.create_block_mask(mask_mod, None, None, L, L) if mask_mod else None
    theirs = flex.create_block_mask(mask_mod, None, None, L, L, device="cpu") if mask_mod else None
    out, lse = acf.flex_attention(q, k, v, score_mod, ours, enable_gqa=True, return_lse=True)
    want, want_lse = flex.flex_attention(q, k, v, score_mod, theirs, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    again, _ = acf.flex_attention(q, k, v, score_mod, theirs, enable_gqa=True, return_lse=True)  # torch's mask
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_each_rows_max_score_with_the_log_sum_exp(backend):
    """``return_aux=AuxRequest(lse=True, max_scores=True)``: each row's largest modified, masked score
    (PyTorch computes it on GPUs only; here against the scores written densely), ``-inf`` for a row
    that sees no key; the output's gradients as without it (the max passes none)."""
    q, k, v = tensors(7, grad=True)

    def hides_row_5(b, h, q_idx, kv_idx):
        return documents(b, h, q_idx, kv_idx) & (q_idx != 5)

    mask = acf.create_block_mask(hides_row_5, None, None, L, L)
    out, aux = acf.flex_attention(
        q, k, v, alibi, mask, enable_gqa=True, return_aux=flex.AuxRequest(lse=True, max_scores=True), backend=backend
    )
    sizes = (B, H, L, L)
    b, h, i, j = (torch.arange(n).reshape([-1 if a == d else 1 for a in range(4)]) for d, n in enumerate(sizes))
    s = alibi((q @ k.repeat_interleave(2, 1).mT) * D**-0.5, b, h, i, j)
    s = torch.where(hides_row_5(b, h, i, j), s, -torch.inf)
    torch.testing.assert_close(aux.max_scores, s.amax(-1).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.lse, torch.logsumexp(s, -1).detach(), rtol=1e-5, atol=1e-5)
    assert aux.max_scores.dtype == torch.float32 and torch.isneginf(aux.max_scores[:, :, 5]).all()
    alone = acf.flex_attention(q, k, v, alibi, mask, enable_gqa=True, backend=backend)
    got = torch.autograd.grad((out**2).sum() + aux.max_scores[:, :, :5].sum(), (q, k, v))
    for a, want in zip(got, torch.autograd.grad((alone**2).sum(), (q, k, v))):
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-5)
    request = flex.AuxRequest(max_scores=True)
    only, aux = acf.flex_attention(q, k, v, alibi, mask, enable_gqa=True, return_aux=request, backend=backend)
    assert aux.lse is None
    torch.testing.assert_close(only, out)


def test_gradients_of_q_k_v_and_a_learned_bias():
    """A relative-position bias the score_mod reads is a leaf that learns: its gradient too."""
    q, k, v = tensors(1, grad=True)
    bias = torch.randn(H, 2 * L, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + L]

    out = acf.flex_attention(q, k, v, relative, acf.create_block_mask(causal, B, H, L, L), enable_gqa=True)
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), cotangent)
    want = dense(q, k, v, relative, causal)
    expected = torch.autograd.grad(want, (q, k, v, bias), cotangent)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, reference in zip(grads, expected):
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5)


def test_one_compile_per_expression_one_fused_attention_and_tiles_classified():
    """Another bias of the same type: the same expression, no new compile. The call is one fused
    attention, whose tiles mask-elimination classifies from the mask's expression (no block evaluated)."""
    q, k, v = tensors(2, heads=KV)
    bias = torch.randn(KV, 2 * L)
    acf.flex_attention(q, k, v, lambda s, b, h, i, j: s + bias[h, i - j + L], acf.create_block_mask(causal, 1, 1, L, L))
    before = len(acf.COMPILED)
    other = torch.randn(KV, 2 * L)
    out = acf.flex_attention(
        q, k, v, lambda s, b, h, i, j: s + other[h, i - j + L], acf.create_block_mask(causal, 1, 1, L, L)
    )
    assert len(acf.COMPILED) == before
    fn = acf.compiled_for(lambda s, b, h, i, j: s + other[h, i - j + L], acf.create_block_mask(causal, 1, 1, L, L), q,
                          D**-0.5, (False, False), "cpu")[0].fn  # fmt: skip
    assert fn.ir("softmax-fusion").count("ac.attention ") == 1 and not fn.remarks
    assert "ac.switch" in fn.ir("mask-elimination")
    torch.testing.assert_close(out, dense(q, k, v, lambda s, b, h, i, j: s + other[h, i - j + L], causal))


def test_decoding_steps_read_their_offset_from_a_tensor_with_one_compile():
    """One query against the keys so far, its position a 0-d tensor changed between steps (as a
    decoding loop keeps it): each step is the dense attention's, and all share one compile."""
    _, k, v = tensors(4)
    offset = torch.tensor(0)

    def seen(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    compiles = None
    for position in (3, 20, L - 1):
        offset.fill_(position)
        q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(position))
        out = acf.flex_attention(q, k, v, block_mask=acf.create_block_mask(seen, None, None, 1, L), enable_gqa=True)
        want = dense(q, k, v, None, seen)  # the same function on index grids: the offset as it is now
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        compiles = compiles or len(acf.COMPILED)
    assert len(acf.COMPILED) == compiles


@TORCH_COMPILE
def test_under_torch_compile_fullgraph_with_gradients_and_new_captured_values(monkeypatch):
    """A layer of two calls (two specs, both compiled while the trace runs) compiles with no graph break,
    its lengths dynamic (the default scale is read from the sizes in the spec, not made a constant of
    the trace); its gradients (a learned slope's included) are the eager call's, and a captured tensor
    changed in place is read as it is each call."""
    from attncomp.torch.traced_ops import TracedOps

    monkeypatch.setattr(acf, "COMPILED", TracedOps())  # none compiled before the trace
    slopes = SLOPES.clone().requires_grad_()

    def layer(q, k, v):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        length = q.shape[2]
        mask = acf.create_block_mask(causal, 1, 1, length, length)
        first = acf.flex_attention(2 * q, k, v, alibi, mask, enable_gqa=True)
        return (acf.flex_attention(first, k, v, softcap, enable_gqa=True) ** 2).sum()

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for length in (L, L - 7):
        q, k, v = (x[:, :, :length].detach().requires_grad_() for x in tensors(3))
        got, want = compiled(q, k, v), layer(q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got, (q, k, v, slopes)), torch.autograd.grad(want, (q, k, v, slopes))):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            slopes.mul_(0.5)
    assert len(acf.COMPILED) == 2


@TORCH_COMPILE
def test_a_modules_numbers_symbolic_in_the_trace_are_compiled_in():
    """``dynamic=True`` makes a module's float attributes symbols of the trace: a scale and a soft-cap
    read from the module are compiled in as the values they have (they failed the trace), guarded: a
    new value recompiles."""

    class Capped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.cap = 0.3, 5.0

        def forward(self, q, k, v):
            def capped(score, b, h, q_idx, kv_idx):
                return self.cap * torch.tanh(score / self.cap)

            return acf.flex_attention(q, k, v, capped, scale=self.scale, enable_gqa=True, backend="interp")

    layer = Capped()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for length, cap in ((L, 5.0), (L - 7, 5.0), (L, 2.0)):
        layer.cap = cap
        q, k, v = (x[:, :, :length] for x in tensors(4))
        want = dense(q, k, v, lambda s, b, h, i, j, c=cap: c * torch.tanh(s / c), None, scale=0.3)
        torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["documents", "neighbourhood", "prefix-lm", "two-sided"])
def test_a_block_masks_blocks_sparsity_and_picture_are_pytorchs(case):
    """``shape``, ``to_dense()``, ``sparsity()`` and ``to_string()`` of attncomp's block mask, evaluated
    when asked, against PyTorch's own block mask of the same function: lengths that are not whole
    blocks, per-batch masks, square and oblong blocks; and torch's mask helpers under the same import."""
    mask_mod = {
        "documents": documents,
        "neighbourhood": neighbours,
        "prefix-lm": acf.or_masks(prefix, causal),
        "two-sided": acf.and_masks(near, acf.noop_mask),
    }[case]
    for batch, heads, block in [(2, 3, 16), (None, None, (8, 16)), (2, None, 128)]:
        ours = acf.create_block_mask(mask_mod, batch, heads, L, L - 3, BLOCK_SIZE=block)
        theirs = flex.create_block_mask(mask_mod, batch, heads, L, L - 3, device="cpu", BLOCK_SIZE=block)
        assert ours.shape == theirs.shape and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
        assert torch.equal(ours.to_dense(), theirs.to_dense())
        assert ours.sparsity() == pytest.approx(theirs.sparsity())
        first = ours.to_string(limit=1).split("...")[0]
        assert first == theirs.to_string(limit=1).split("...")[0] and first.count("\n") > 2
    dense_mask = acf.create_mask(mask_mod, 2, 1, L, L)
    assert dense_mask.shape == (2, 1, L, L) and dense_mask.dtype == torch.bool
    with pytest.raises(ValueError, match="BLOCK_SIZE must be a positive int"):
        acf.create_block_mask(causal, 1, 1, L, L, BLOCK_SIZE=0)


def test_an_indexed_block_mask_is_pytorchs_and_attends_for_the_entries_it_picks():
    """``mask[b]``, ``mask[b, h]``, slices, index tensors and query blocks: the same ``shape``, blocks
    and sparsity as PyTorch's indexed block mask; indexed by batch and heads, it is the mask of the
    entries it picks for a call on them (PyTorch's sliced mask has no ``mask_mod`` left)."""

    def staggered(b, h, q_idx, kv_idx):  # a mask of the batch entry and head too
        return documents(b, h, q_idx, kv_idx) & ((kv_idx + 3 * b + h) % 5 != 0)

    ours = acf.create_block_mask(staggered, 4, 3, L, L - 3, BLOCK_SIZE=8)
    theirs = flex.create_block_mask(staggered, 4, 3, L, L - 3, device="cpu", BLOCK_SIZE=8)
    picks = [0, -1, (1, 2), (slice(1, 3),), (slice(None), slice(0, 3, 2)), (torch.tensor([3, 0]), -2)]
    for index in [*picks, (2, 1, torch.tensor([1, 3])), (slice(1, 4), slice(None), slice(1, 4))]:
        mine, pytorchs = ours[index], theirs[index]
        assert mine.shape == pytorchs.shape and torch.equal(mine.to_dense(), pytorchs.to_dense())
        assert mine.sparsity() == pytest.approx(pytorchs.sparsity())
    assert ours.to_string(limit=2) == theirs.to_string(limit=2)  # the hint to index, after the limit
    q, k, v = (torch.randn(4, 3, L, D, generator=torch.Generator().manual_seed(n)) for n in range(3))
    whole = flex.flex_attention(q, k, v, block_mask=flex.create_block_mask(staggered, 4, 3, L, L, device="cpu"))
    mask = acf.create_block_mask(staggered, 4, 3, L, L)
    for index, rows, heads in [
        ((slice(2, 4),), [2, 3], [0, 1, 2]),
        ((torch.tensor([3, 0]), slice(0, 3, 2)), [3, 0], [0, 2]),
    ]:
        picked = [x[rows][:, heads] for x in (q, k, v)]
        out = acf.flex_attention(*picked, block_mask=mask[index], backend="cpu")
        torch.testing.assert_close(out, whole[rows][:, heads], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="indexed along its query blocks"):
        acf.flex_attention(q, k, v, block_mask=mask[:, :, 1:3])
    with pytest.raises(ValueError, match=r"the call has 30 and 35 \(block_mask._adjust\(30, 35\) crops"):
        acf.flex_attention(q[:, :, :30], k[:, :, :35], v[:, :, :35], block_mask=mask)
    mine, pytorchs = ours._adjust(30, 35), theirs._adjust(30, 35)  # as PyTorch's: its upper left corner
    assert mine.shape == pytorchs.shape and torch.equal(mine.to_dense(), pytorchs.to_dense())
    cropped = mask._adjust(30, 35)
    out = acf.flex_attention(q[:, :, :30], k[:, :, :35], v[:, :, :35], block_mask=cropped, backend="cpu")
    want = dense(q[:, :, :30], k[:, :, :35], v[:, :, :35], None, staggered).nan_to_num(0.0)  # rows seeing no key
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError, match="index 4 is out of range for the batch"):
        mask[4]


def test_what_cannot_be_compiled_is_refused_by_name():
    q, k, v = tensors()
    with pytest.raises(NotImplementedError, match="branches on a tensor's value"):
        acf.flex_attention(q, k, v, lambda s, b, h, i, j: s if i > j else -s, enable_gqa=True)
    with pytest.raises(NotImplementedError, match=r"calls torch\.erf"):
        acf.flex_attention(q, k, v, lambda s, b, h, i, j: torch.erf(s), enable_gqa=True)
    with pytest.raises(TypeError, match="torch.int16"):
        table = torch.zeros(L, dtype=torch.int16)
        same = acf.create_block_mask(lambda b, h, i, j: table[i] == table[j], 1, 1, L, L)
        acf.flex_attention(q, k, v, block_mask=same, enable_gqa=True)
    with pytest.raises(ValueError, match="made for 8 queries and 8 keys"):
        acf.flex_attention(q, k, v, block_mask=acf.create_block_mask(causal, 1, 1, 8, 8), enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        acf.flex_attention(q, k, v)


def random_lists(seed: int, heads: int, rows: int, blocks: int):
    """Each block's kind for a batch of 1 (shared) and ``heads`` heads (0 hidden, 1 partial, 2 full),
    drawn at random, and FlexAttention's lists of them."""
    generator = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, (1, heads, rows, blocks), generator=generator)
    return kind, lists_of(kind)


def lists_of(kind):
    """FlexAttention's lists of each block's kind (sorted; the unused slots arbitrary)."""
    blocks = kind.shape[-1]
    lists = []
    for code in (1, 2):
        chosen = kind == code
        num = chosen.sum(-1).to(torch.int32)
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # chosen blocks first, in order
        lists += [num, torch.where(torch.arange(blocks) < num[..., None], order, blocks - 1).to(torch.int32)]
    return lists


@pytest.mark.parametrize("mask_mod", [None, causal], ids=["lists", "lists-and-causal"])
def test_a_block_mask_from_lists_of_blocks_is_its_lists(mask_mod):
    """torch's ``BlockMask.from_kv_blocks`` without a ``mask_mod`` is its lists (a partial block shown
    whole), as PyTorch's compiled kernels take it (its eager reference reads the function alone);
    attncomp's ``from_kv_blocks`` makes the same mask, and with a ``mask_mod`` the lists and the
    function together (full blocks whole, partial ones where the function shows an entry).  Rows
    that see no key are zeros with LSE -inf."""
    q, k, v = tensors(9)
    kind, lists = random_lists(3, H, L // 8, L // 8)
    kind[0, 0, 0], kind[0, 1, 1] = 0, 0  # head 0's first query block and head 1's second see no key
    lists = lists_of(kind)
    theirs = flex.BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=8, mask_mod=mask_mod, seq_lengths=(L, L))
    ours = acf.BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=8, mask_mod=mask_mod)
    per_entry = kind.repeat_interleave(8, -1).repeat_interleave(8, -2)

    def shown(b, h, i, j):
        function = True if mask_mod is None else mask_mod(b, h, i, j)
        return (per_entry[0, h, i, j] == 2) | ((per_entry[0, h, i, j] == 1) & function)

    want = dense(q, k, v, None, shown)
    if mask_mod is None:
        assert torch.equal(ours.to_dense(), theirs.to_dense())
        assert ours.sparsity() == pytest.approx(theirs.sparsity())
    # torch's mask with a mask_mod stands for that function alone (create_block_mask lists what it shows)
    for block_mask in (theirs, ours) if mask_mod is None else (ours,):
        out, lse = acf.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
        seen = torch.isfinite(lse)
        torch.testing.assert_close(out[seen], want[seen], rtol=1e-5, atol=1e-5)
        assert torch.equal(out[~seen], torch.zeros_like(out[~seen])) and (~seen).any() and seen.any()


def test_torchs_mask_that_shows_every_block_whole_is_no_mask():
    everything = flex.create_block_mask(flex.noop_mask, None, None, L, L, device="cpu")
    from attncomp.flex import _mask_mod

    assert _mask_mod(everything) is None


@TORCH_COMPILE
def test_a_block_mask_of_lists_under_torch_compile_fullgraph():
    """PyTorch's block mask of lists passed to a compiled function: its table of codes is made in the
    graph and recorded without a torch op on it (no graph break), with the eager call's result."""
    q, k, v = tensors(10)
    kind = random_lists(4, H, L // 8, L // 8)[0]
    mask = flex.BlockMask.from_kv_blocks(*lists_of(kind), BLOCK_SIZE=8, seq_lengths=(L, L))
    call = torch.compile(lambda q, k, v, m: acf.flex_attention(q, k, v, block_mask=m, enable_gqa=True), fullgraph=True)
    torch.testing.assert_close(call(q, k, v, mask), acf.flex_attention(q, k, v, block_mask=mask, enable_gqa=True))
