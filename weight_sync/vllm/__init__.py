"""vLLM's compatibility: our receiver inside vLLM's workers (`extension`, `target`,
`checkpoint_params`), and the group and wire of a trainer written for vLLM's RL routes (`group`,
`packing`, `nccl_unique_id`, `nccl_comm`). vllm itself is imported only when asked for."""
