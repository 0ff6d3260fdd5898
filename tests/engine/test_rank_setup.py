"""engine/rank_setup.py: the bound of the prefill-only graphs."""

from mambaserve.config import DEFAULT_SOLO_GRAPH_TOKENS, EngineConfig
from mambaserve.engine.rank_setup import solo_graph_tokens


def test_solo_graph_bound():
    c = EngineConfig(chunked_prefill_size=4096)
    assert DEFAULT_SOLO_GRAPH_TOKENS == 2048
    assert solo_graph_tokens(c, 256, max_model_len=8192) == 2048  # the default
    assert solo_graph_tokens(c, 1536, max_model_len=8192) == 3072  # twice a larger bound
    assert solo_graph_tokens(c, 256, max_model_len=600) == 600  # no lone prompt is longer
    assert solo_graph_tokens(c, 256, max_model_len=100) == 256  # never below the bound
    assert solo_graph_tokens(EngineConfig(chunked_prefill_size=1024), 256, 8192) == 1024
    set_ = EngineConfig(chunked_prefill_size=4096, cuda_graph_max_solo_tokens=3000)
    assert solo_graph_tokens(set_, 256, max_model_len=600) == 3000  # as set, up to the chunk
    assert solo_graph_tokens(EngineConfig(cuda_graph_max_solo_tokens=64), 256, 8192) == 256
