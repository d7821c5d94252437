"""engine/'s layout holds (docs/design/engine.md, "Layout"): the core step and the process boundary
at the top, the model code in engine.models, the kernels in engine.kernels; imports run downward
(the top -> models -> kernels), and the engine never imports the sidecar (rollout) or weight_sync."""

import pathlib

from tests.layout import imported_modules

ROOT = pathlib.Path(__file__).resolve().parents[2] / "engine"
# what model code may import from the top: leaves that import no engine module themselves
TOP_LEAVES = ("engine.config", "engine.errors")
TOP = [
    "__init__.py", "async_engine.py", "block_manager.py", "config.py", "core.py", "core_connection.py", "core_proc.py",
    "cpu_preload.py", "decode_buckets.py", "decode_graphs.py", "engine_client.py", "errors.py", "exact_logprobs.py",
    "gpu_memory.py", "grouped_blocks.py", "inputs.py", "kv_cache_size.py", "kv_groups.py", "llm.py",
    "logits_processors.py", "lora_bank.py", "memory_profile.py", "memory_report.py", "messages.py", "model_runner.py",
    "output_collector.py", "output_processor.py", "outputs.py", "prompt_logprobs.py", "routed_experts.py",
    "sampler.py", "sampling_params.py", "scheduler.py", "seeded_draws.py", "sequence.py", "serial.py", "standby.py",
    "step_inputs.py", "step_sampling.py", "stop_checker.py", "tokenizer.py", "vllm_convert.py", "vllm_engine.py",
    "vllm_start.py", "worker.py",
]


def _wrong(place: str, allowed: tuple[str, ...]) -> list[str]:
    """The imports of engine modules by engine/<place>/*.py outside `allowed`."""
    wrong = []
    for path in sorted((ROOT / place).glob("*.py")):
        for line, module in imported_modules(path):
            if module.startswith("engine.") and not module.startswith(allowed):
                wrong.append(f"engine/{place}/{path.name}:{line} imports {module}")
    return wrong


def test_kernels_import_no_model_code_and_nothing_of_the_top():
    wrong = _wrong("kernels", ("engine.kernels.",))
    assert not wrong, "\n".join(wrong)


def test_model_code_imports_kernels_and_the_tops_leaves_only():
    wrong = _wrong("models", ("engine.models.", "engine.kernels.", *(f"{m}." for m in TOP_LEAVES)))
    assert not wrong, "\n".join(wrong)
    for leaf in TOP_LEAVES:
        path = ROOT / f"{leaf.split('.')[1]}.py"
        assert not [m for _, m in imported_modules(path) if m.startswith("engine.")], f"{leaf} imports an engine module"


def test_the_engine_never_imports_the_sidecar_or_weight_sync():
    wrong = [f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
             for path in sorted(ROOT.rglob("*.py")) for line, module in imported_modules(path)
             if module.split(".")[0] in ("rollout", "weight_sync")]
    assert not wrong, "\n".join(wrong)


def test_the_top_holds_the_core_step_and_the_process_boundary_the_rest_in_its_places():
    assert sorted(p.name for p in ROOT.glob("*.py")) == TOP
    assert sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("__")) == [
        "kernels", "models"]
    assert (ROOT / "kernels" / "native" / "common.h").is_file()  # the C sources beside their glue
