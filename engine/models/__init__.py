"""The model code: the engine's own Llama-shaped and MoE models (llama_model, moe_model), their
decoder layers (fused_layers; native_layers: a decode step's layers in one C call) and attention
over the paged KV cache, rope scaling, expert names, how a model directory is loaded
(model_loader), and where model directories come from (tiny_model, real_models, gguf_convert,
model_names).

Model code calls the kernels (engine.kernels); the kernels never import it."""
