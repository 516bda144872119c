# ruff: noqa: F821
"""The mask function's facts (no T x S tensor), refusals, and a user's own spec (ALiBi on GPT-2)."""

import weakref

import pytest

from tests.hf.models import VOCAB, WINDOW, T, assert_same_model_outputs, gpt2_config, mistral_config, padded_batch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attncomp as ac  # noqa: E402
import attncomp.hf  # noqa: E402
from attncomp.hf import MaskFacts  # noqa: E402
from examples.hf_alibi import alibi_slopes, build_model, generate_copies, train  # noqa: E402


def facts_of(make_config, ids, mask, **kwargs) -> dict:
    """Every mask the model's forward builds, by the layer type it serves."""
    seen = {}
    original = attncomp.hf.attncomp_mask

    def spy(**arguments):
        facts = original(**arguments)
        seen["sliding" if arguments.get("local_size") else "full"] = facts
        return facts

    attncomp.hf.register()
    transformers.AttentionMaskInterface.register("attncomp", spy)
    try:
        model = transformers.AutoModelForCausalLM.from_config(make_config(), attn_implementation="attncomp")
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **kwargs)
    finally:
        attncomp.hf.register()
    return seen


def test_masks_are_facts_of_size_b_times_t_never_b_t_s():
    ids, mask = padded_batch("left")
    facts = facts_of(mistral_config, ids, mask)["sliding"]
    assert isinstance(facts, MaskFacts) and facts.window == WINDOW and facts.causal
    assert facts.shift.tolist() == [0, 0, 0]
    assert facts.q_doc.shape == facts.k_doc.shape == (3, T)
    assert facts.k_doc.tolist()[2] == [-1] * (T - 3) + [0] * 3  # the padded keys
    for tensor in (facts.shift, facts.q_doc, facts.k_doc):
        assert tensor.dtype == torch.int32 and tensor.numel() <= 3 * T


def test_packed_position_ids_become_document_ids():
    ids = torch.randint(1, VOCAB, (1, T))
    positions = torch.cat([torch.arange(5), torch.arange(4), torch.arange(3)])[None]
    facts = facts_of(mistral_config, ids, None, position_ids=positions, use_cache=False)["sliding"]
    assert facts.q_doc.tolist() == [[0] * 5 + [1] * 4 + [2] * 3]
    assert facts.k_doc is facts.q_doc
    plain = facts_of(mistral_config, ids, None, use_cache=False)["sliding"]
    assert plain.q_doc is None  # one sequence per row: the spec without segments


def packed_4d_mask(kind: str) -> torch.Tensor:
    """Two sequences packed in each row, each causal on its own (5 + 7 and 9 + 3 tokens), as a
    caller's 4D mask: boolean, or float with the type's lowest value where hidden."""
    rows = []
    for first in (5, 9):
        doc = (torch.arange(T) >= first).long()
        rows.append((doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril())
    mask = torch.stack(rows)[:, None]
    if kind == "bool":
        return mask
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_four_dimensional_mask_is_attended_as_sdpa_attends_it(kind):
    """A 4D mask passed to the model reaches the attention as it is: attended as data (each tile
    classified from it), logits, loss and every gradient as ``sdpa``'s on the same mask."""
    from tests.hf.models import llama_config, model_pair

    ours, theirs = model_pair(llama_config)
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    mask = packed_4d_mask(kind)
    assert_same_model_outputs(ours, theirs, ids, mask, real=torch.ones_like(ids, dtype=torch.bool))
    with torch.no_grad():  # the mask matters: the same tokens causally, unpacked, differ
        unpacked = ours(input_ids=ids).logits
        assert not torch.allclose(unpacked, ours(input_ids=ids, attention_mask=mask).logits, atol=1e-3)


def test_a_mask_per_head_with_biases_is_added_as_sdpa_adds_it():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attncomp.hf.register()
    torch.manual_seed(1)
    batch, heads, kv_heads, d = 2, 4, 2, 16
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads
    q, k, v = (torch.randn(batch, n, T, d, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    bias = torch.randn(batch, heads, T, T + 3)  # longer than the keys (a static cache's): cut to them
    bias[:, 1, :, 6:] = -torch.inf
    bias[0, 2, :6, :] = torch.finfo(torch.float32).min
    bias[0, 2, :6, 0] = 0.5
    got, _ = transformers.AttentionInterface()["attncomp"](module, q, k, v, bias, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, bias[..., :T], scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    cotangent = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), cotangent), torch.autograd.grad(want, (q, k, v), cotangent)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rows = bias[..., :T].clone()  # a position bias for each batch row, over the layer's own causal mask
    got, _ = transformers.AttentionInterface()["attncomp"](module, q, k, v, None, scaling=0.25, position_bias=rows)
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, position_bias=rows, is_causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    shared = bias[:, :1, :, :T]  # one mask for every head: hf_attention_bias
    got, _ = transformers.AttentionInterface()["attncomp"](module, q, k, v, shared, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, shared, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attention_mask: a 4D mask must be"):
        transformers.AttentionInterface()["attncomp"](module, q, k, v, bias[:, :3], scaling=0.25)


def test_a_float_mask_of_zeros_and_the_lowest_value_is_attended_as_a_boolean_one():
    from attncomp.hf.attention import boolean_form

    mask = packed_4d_mask("float")
    form = boolean_form(mask)
    assert form.dtype == torch.bool and torch.equal(form, packed_4d_mask("bool"))
    assert boolean_form(mask) is form  # read once for every layer of a forward
    mask[0, 0, 0, 0] = 0.5  # a bias: added, as it is
    assert boolean_form(mask) is mask and boolean_form(mask) is mask
    held = weakref.ref(mask)
    del mask, form
    assert held() is None  # nothing kept the mask past its use
    assert boolean_form(packed_4d_mask("float").requires_grad_()).dtype == torch.float32  # it learns


def test_every_default_specs_dropout_variant_is_one_fused_attention():
    """``with_dropout`` of each default spec: one ``ac.attention`` with a weight region (the dropout
    inside the fused kernels, no T x S mask), its seed read as ``seed[0]``."""
    hf = attncomp.hf
    defaults = [*hf.DEFAULT_SPECS.values(), *hf.MASK_SPECS.values()]
    for base in [*defaults, hf.hf_attention_position_bias, hf.hf_attention_position_bias_rows]:
        fn = ac.compile(hf.with_dropout(base), backend="interp", dropout=0.1)
        fused = [op for op in ac.parse_ir(fn.ir("softmax-fusion")).main.body.ops if op.name == "ac.attention"]
        assert not fn.remarks and len(fused) == 1 and len(fused[0].regions) == 3, (base.name, fn.remarks)


def test_a_spec_that_cannot_apply_the_padding_is_refused():
    @ac.spec
    def causal_only(
        q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "D"]
    ):
        s = q @ k.mT
        b, h, i, j = ac.index(s)
        return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v

    attncomp.hf.register("causal_only", spec=causal_only)
    model = transformers.AutoModelForCausalLM.from_config(gpt2_config(), attn_implementation="causal_only")
    ids, mask = padded_batch("right")
    with pytest.raises(TypeError, match="takes no q_doc and k_doc"):
        model(input_ids=ids, attention_mask=mask)


def test_unknown_backend_and_non_spec_are_refused():
    with pytest.raises(ValueError, match="backend"):
        attncomp.hf.register("x", backend="tpu")
    with pytest.raises(TypeError, match="ac.spec"):
        attncomp.hf.register("x", spec=lambda q, k, v: q)


def reference_alibi(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The same ALiBi in torch ops, on the 4D boolean mask ``sdpa_mask`` builds."""
    scores = (query @ key.transpose(-1, -2)) * scaling
    t, s = query.shape[2], key.shape[2]
    distance = torch.arange(s)[None, :] - (torch.arange(t)[:, None] + s - t)
    scores = scores + module.slopes[None, :, None, None] * distance
    visible = distance <= 0 if attention_mask is None else attention_mask
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return (weights @ value).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module")
def alibi_pair():
    transformers.AttentionInterface.register("alibi_reference", reference_alibi)
    transformers.AttentionMaskInterface.register("alibi_reference", transformers.masking_utils.sdpa_mask)
    ours = build_model(vocab=VOCAB, seed=11)
    theirs = build_model(vocab=VOCAB, seed=11)
    theirs.set_attn_implementation("alibi_reference")
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "alibi" and theirs.config._attn_implementation == "alibi_reference"
    for model in (ours, theirs):
        for h, block in enumerate(model.transformer.h):
            block.attn.slopes.data = torch.tensor(alibi_slopes(4)) * (h + 1)
    return ours.eval(), theirs.eval()


@pytest.mark.parametrize("side", ["left", "right"])
def test_users_alibi_spec_matches_the_torch_formula_slopes_gradients_included(alibi_pair, side):
    ids, mask = padded_batch(side, seed=12)
    assert_same_model_outputs(*alibi_pair, ids, mask)
    assert all(block.attn.slopes.grad is not None for block in alibi_pair[0].transformer.h)


def test_users_alibi_spec_generates_as_the_torch_formula(alibi_pair):
    ours, theirs = alibi_pair
    ids, mask = padded_batch("left", seed=13)
    settings = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))


def test_the_example_learns_to_copy_and_generates_the_copy():
    model = build_model(seed=0)
    losses = train(model, 60)
    assert losses[-1] < 0.5 * losses[0]
    right, total = generate_copies(model)  # generate runs through the spec with a cache and padding
    assert total == 12 and 0 <= right <= total


def test_a_float32_spec_with_a_python_float_slope_runs_in_a_float32_model():
    """A constant slope per head written with a Python float keeps the spec float32: the model's
    output projection gets float32 (a float64 result failed there), and the attention fuses."""

    @ac.spec
    def constant_alibi(
        q: ac.f32["B", "H", "T", "D"],
        k: ac.f32["B", "H", "S", "D"],
        v: ac.f32["B", "H", "S", "E"],
        shift: ac.i32["B"],
        q_doc: ac.i32["B", "T"],
        k_doc: ac.i32["B", "S"],
        *,
        scale: float = 1.0,
    ):
        s = (q @ k.mT) * scale
        b, h, i, j = ac.index(s)
        position = i + shift[b]
        slope = ac.exp((h + 1) * -1.386)
        s = ac.where((j <= position) & (q_doc[b, i] == k_doc[b, j]), s + slope * (j - position), -ac.inf)
        return ac.softmax(s, axis=-1) @ v

    attncomp.hf.register("constant_alibi", spec=constant_alibi)
    model = transformers.AutoModelForCausalLM.from_config(gpt2_config(), attn_implementation="constant_alibi")
    ids, mask = padded_batch("left", seed=14)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert "f64" not in str(constant_alibi.ir)
    fn = ac.compile(constant_alibi, backend="cpu")
    assert not fn.remarks and fn.ir("softmax-fusion").count("ac.attention ") == 1


def test_bidirectional_blocks_are_read_from_the_mask_and_attended_as_sdpa_does():
    """``block_sequence_ids`` (an image's tokens see each other, earlier and later: Gemma 3,
    PaliGemma): transformers folds them into the mask function it passes, so the blocks are read
    back from the mask on the diagonal above the main one, and the attention, with padding, and
    its gradients match ``sdpa`` on the dense mask."""
    from transformers import masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tests.hf.models import llama_config

    attncomp.hf.register()
    torch.manual_seed(0)
    batch, heads, kv_heads, d = 2, 4, 2, 16
    blocks = torch.full((batch, T), -1)
    blocks[0, 2:6] = 0
    blocks[1, 5:9], blocks[1, 9:11] = 0, 1  # two images side by side
    padding = torch.ones(batch, T, dtype=torch.long)
    padding[1, :2] = 0

    def mask(implementation: str, block_sequence_ids=blocks):
        config = llama_config()
        config._attn_implementation = implementation
        positions = torch.arange(T)[None].expand(batch, -1)
        embeddings = torch.zeros(batch, T, config.hidden_size)
        return masking_utils.create_causal_mask(
            config, embeddings, padding, None, position_ids=positions, block_sequence_ids=block_sequence_ids
        )

    facts = mask("attncomp")
    assert facts.k_blk.tolist() == [[-1, -1] + [0] * 4 + [-1] * 6, [-1] * 5 + [0] * 4 + [1] * 2 + [-1]]
    assert torch.equal(facts.q_blk, facts.k_blk)  # the queries are the keys' tokens
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads
    q, k, v = (torch.randn(batch, n, T, d, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    got, _ = transformers.AttentionInterface()["attncomp"](module, q, k, v, facts, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask("sdpa"), scaling=0.25)
    real = padding.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    causal_only, _ = sdpa_attention_forward(module, q, k, v, mask("sdpa", None), scaling=0.25)
    assert not torch.allclose(causal_only[real], want[real], atol=1e-3)  # the blocks change the result
    cotangent = torch.randn_like(got) * real[..., None, None]
    grads = torch.autograd.grad(got, (q, k, v), cotangent)
    expected = torch.autograd.grad(want, (q, k, v), cotangent)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_bidirectional_window_is_two_sided_and_another_pattern_is_refused():
    """A bidirectional sliding window (``|i - j| <= sliding_window``, from a builder that passes
    ``allow_is_bidirectional_skip``) is no causal mask: its facts say so, with the window
    that shows the keys less than ``window`` positions away; a bidirectional mask whose local pattern is
    another one is refused, not attended as a window."""
    from transformers import masking_utils

    mask = attncomp.hf.attncomp_mask
    two_sided = masking_utils.sliding_window_bidirectional_mask_function(3)
    bidirectional = dict(allow_is_bidirectional_skip=False)  # what transformers' bidirectional builders pass
    facts = mask(batch_size=2, q_length=T, kv_length=T, mask_function=two_sided, local_size=3, **bidirectional)
    assert not facts.causal and facts.window == 4 and facts.q_blk is None and facts.q_doc is None
    causal = masking_utils.sliding_window_causal_mask_function(3)
    facts = mask(batch_size=2, q_length=T, kv_length=T, mask_function=causal, local_size=3)
    assert facts.causal and facts.window == 3
    one_sided = masking_utils.and_masks(
        masking_utils.sliding_window_overlay(3), masking_utils.bidirectional_mask_function
    )
    with pytest.raises(NotImplementedError, match="bidirectional mask with local_size=3"):
        mask(batch_size=2, q_length=T, kv_length=T, mask_function=one_sided, local_size=3, **bidirectional)
