"""8-bit key/value caches are not lowered on the cuda backend yet: asking for one says so, naming
the backend, before anything is compiled."""

import pytest

import attncomp as ac
from tests.passes import specs


def test_an_8bit_cache_on_cuda_is_refused_naming_the_backend():
    fn = ac.compile(specs.causal_alibi, backend="cuda")
    with pytest.raises(ValueError, match=r"cache='f8e4m3': 8-bit key/value caches run on the cpu and interp backends"):
        fn.decoder(max_len=16, cache="f8e4m3")
    with pytest.raises(ac.AttncompError, match=r"an 8-bit key/value cache \(f8e5m2\) .* the cuda backend"):
        ac.compile(specs.causal_alibi, backend="cuda", pipeline="softmax-fusion,kv-cache-reuse{cache=f8e5m2}")
