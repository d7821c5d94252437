"""SGLang's compatibility: the group and wire of a trainer written for SGLang's RL weight API
(`group`: its process group as SGLang forms it; `wire`: its update calls as manifests), beside
vLLM's (weight_sync/vllm). The engine's workers hold either in their one foreign-group slot."""
