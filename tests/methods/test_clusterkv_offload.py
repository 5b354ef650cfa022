"""ClusterKV's offload="cpu" without a GPU: the option's errors, which fields it places in host memory, cache_bytes's
host/device split, and the bench's method-option systems. The offloaded runs themselves are in
test_clusterkv_offload_gpu.py."""
import pytest
import torch

import kvrewrite
from kvrewrite.bench import e2e
from kvrewrite.capture import LayerInfo
from kvrewrite.methods.clusterkv import ClusterKVMethod
from kvrewrite.offload import check_offload_device
from kvrewrite.state import allocate_layer_state

SMALL = dict(n_sink=2, interval=4, tokens_per_cluster=4, window_clusters=2, iters=3, dense_layers=1)


def _layer(index):
    return LayerInfo(index=index, num_heads=4, num_kv_heads=2, head_dim=16, window=0)


@pytest.mark.parametrize("bad", ["gpu", "CPU", "", True, 1])
def test_bad_offload_value_names_the_option(bad):
    with pytest.raises(ValueError, match=r"ClusterKVMethod\.offload must be None .* or 'cpu'"):
        ClusterKVMethod(offload=bad)


def test_offload_places_the_clustered_layers_keys_and_values_on_the_host():
    m = ClusterKVMethod(offload="cpu", dense_layers=2)
    assert m.host_fields(_layer(0)) == m.host_fields(_layer(1)) == ()  # dense layers: every row read each step
    assert m.host_fields(_layer(2)) == ("keys", "values")
    assert ClusterKVMethod().host_fields(_layer(2)) == ()
    assert kvrewrite.methods.make_method("h2o").host_fields(_layer(2)) == ()  # Method's default


def test_other_methods_refuse_offload(llama):
    with pytest.raises(ValueError, match=r"bad option for method 'h2o'.*offload"):
        kvrewrite.apply(llama, "h2o", budget=0.5, max_length=48, prefill_chunk=8, offload="cpu")


def test_offload_needs_a_cuda_model(llama):
    with pytest.raises(ValueError, match=r"clusterkv offload='cpu' .* needs the model on a CUDA GPU .*drop the "
                                         r"offload option or load the model on a GPU"):
        kvrewrite.apply(llama, "clusterkv", budget=10, max_length=48, prefill_chunk=8, offload="cpu", **SMALL)
    with pytest.raises(ValueError, match="needs the model on a CUDA GPU"):
        check_offload_device("cpu")


def test_only_keys_and_values_can_live_on_the_host():
    with pytest.raises(ValueError, match=r"only keys and values can live in host memory, got \['bias'\]"):
        allocate_layer_state(1, 2, 8, 16, torch.float32, "cpu", host_fields=("keys", "bias"))


def test_cache_bytes_without_offload_is_all_on_the_device(llama):
    rw = kvrewrite.apply(llama, "clusterkv", budget=10, max_length=48, prefill_chunk=8, **SMALL)
    mem = rw.cache_bytes()
    assert mem["host"] == 0 and mem["device"] == mem["kvrewrite"] > 0
    assert mem["ratio"] == mem["kvrewrite"] / mem["dense"]


def test_bench_systems_take_method_options():
    assert e2e.split_system("clusterkv:offload=cpu:iters=10:budget=0.5") == (
        "clusterkv", {"offload": "cpu", "iters": 10, "budget": 0.5})
    assert e2e.split_system("full") == ("full", {})
    m = e2e.make_system_method("clusterkv:offload=cpu", 1024)
    assert m.offload == "cpu" and m.budget == 1024
    assert e2e.method_interval("clusterkv:offload=cpu:interval=64", 1024) == 64
    with pytest.raises(ValueError, match="method options are key=value, got 'offload'"):
        e2e.split_system("clusterkv:offload")
    with pytest.raises(ValueError, match="bad option for method 'h2o'"):
        e2e.make_system_method("h2o:offload=cpu", 0.5)
