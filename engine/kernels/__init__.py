"""The engine's kernels: the linear layers of each precision (fp32 panels, bf16 and int8 on AMX
tiles, oneDNN's prepacked, int8 and fp8 copies, fused q/k/v and gate/up), their C sources
(native/, compiled at first use by native_kernels) and the Python glue that calls them (decode
attention, the layer's elementwise steps, sampling, quantization, the MoE block, the LoRA merge),
the derived copies of the weights they read (derived_weights), and the pages those weights and the
KV cache live on (huge_pages, zero_pages).

Kernels know tensors and modules, never a model: nothing here imports engine.models or the core."""
