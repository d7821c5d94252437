"""bench/read_bound.py: the bytes a workload must read, counted by hand on small cases."""

from bench.read_bound import kv_bytes_per_token, read_bytes


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    cfg = {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 28,
           "hidden_size": 2048}
    assert kv_bytes_per_token(cfg, 2) == 2 * 28 * 8 * 128 * 2
    mha = {"num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30}  # no kv heads, no head_dim
    assert kv_bytes_per_token(mha, 4) == 2 * 30 * 9 * 64 * 4


def test_read_bytes_is_the_weights_each_step_and_each_sequences_kv_each_decode_step():
    # two prompts (lengths 3 and 5, 2 and 4 tokens asked), 2 samples each: 4 steps (the prefill + 3)
    got = read_bytes([3, 5], [2, 4], n=2, weight_bytes=1000, kv_per_token=10)
    kv_tokens = 2 * (3 + 1) + 2 * ((5 + 1) + (5 + 2) + (5 + 3))
    assert got == 4 * 1000 + kv_tokens * 10
    assert read_bytes([3], [1], n=8, weight_bytes=1000, kv_per_token=10) == 1000  # the prefill alone
