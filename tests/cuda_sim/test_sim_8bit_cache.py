"""8-bit key/value caches and pages are not lowered on the cuda backend yet: asking for one says so,
naming the argument and the backend, before anything is compiled."""

import pytest

import attncomp as ac
from tests.passes import specs


def test_an_8bit_cache_on_cuda_is_refused_naming_the_backend():
    fn = ac.compile(specs.causal_alibi, backend="cuda")
    with pytest.raises(ValueError, match=r"cache='f8e4m3': 8-bit key/value caches run on the cpu and interp backends"):
        fn.decoder(max_len=16, cache="f8e4m3")
    with pytest.raises(ac.AttncompError, match=r"an 8-bit key/value cache \(f8e5m2\) .* the cuda backend"):
        ac.compile(specs.causal_alibi, backend="cuda", pipeline="softmax-fusion,kv-cache-reuse{cache=f8e5m2}")


def test_8bit_pages_on_cuda_are_refused_naming_the_argument_and_the_backend():
    fn = ac.compile(specs.causal_alibi, backend="cuda")
    with pytest.raises(
        ValueError, match=r"^cache=.f8e5m2.: 8-bit key/value pages run on the cpu and interp backends; the cuda"
    ):
        fn.paged_decoder(page_size=8, num_pages=4, cache=ac.f8e5m2)
    with pytest.raises(ValueError, match=r"^cache: an 8-bit cache type is one of f8e4m3, f8e5m2"):
        fn.paged_decoder(page_size=8, num_pages=4, cache="e4m3")
    pipeline = "softmax-fusion,chunk-pairs{ragged=true,paged=true,cache=f8e4m3},flash-tiling"
    with pytest.raises(ac.AttncompError, match=r"an 8-bit key/value cache \(f8e4m3\) .* the cuda backend"):
        ac.compile(specs.causal_alibi, backend="cuda", pipeline=pipeline)
