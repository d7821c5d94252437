"""What `rollout.serve` checks before it starts anything: each bad argument ends it with one line
(exit 1; argparse's own errors exit 2), never a traceback after seconds of engine start-up."""

from __future__ import annotations

import json
import os
import socket


def model_problem(arg: str, model_dir: str) -> str | None:
    """Why `--model arg` (resolved to `model_dir`) cannot be served, or None."""
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return None
    from engine.models.real_models import PRESETS
    from engine.models.tiny_model import SIZES

    what = "no such directory" if not os.path.exists(model_dir) else "a directory without config.json"
    return (f"--model {arg!r}: {what}; give an HF model directory or a name: {', '.join(PRESETS)} (a real "
            f"model) or {', '.join(SIZES)} (embedded tiny models)")


def model_max_len(model_dir: str) -> int | None:
    """The positions the model holds (its config's max_position_embeddings), if it says."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    n = config.get("max_position_embeddings")
    return int(n) if isinstance(n, int) and n > 0 else None


def max_len_problem(asked: int, held: int | None) -> str | None:
    if held is not None and asked > held:
        return (f"--max-model-len {asked} is more than the model holds ({held} positions, its "
                f"max_position_embeddings): leave it unset to use {held}")
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now (a port another process listens on), or None."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror} (--port 0 picks a free port)"
    return None


def chat_template_text(arg: str) -> str:
    """--chat-template: a file's text, or the argument itself when it is a template (vLLM's rule);
    ValueError when it is neither."""
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            return f.read()
    if any(mark in arg for mark in ("{{", "{%", "\n")):
        return arg
    raise ValueError(f"--chat-template {arg!r}: no such file, and not a Jinja template")
