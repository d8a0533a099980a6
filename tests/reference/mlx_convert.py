"""A checkpoint quantized by mlx-lm itself, as mlx-community's files are made: the float
checkpoint loaded by `mlx_lm.utils.load_model`, quantized by `mlx_lm.utils.quantize_model`
(with Ouro's own `quant_predicate`) and written by `save_model` and `save_config`, the
tokenizer copied beside it. spex then reads it like any mlx-community download
(`mlx_quant.py` checks spex's output against mlx-lm's on it).

usage: python3 mlx_convert.py SOURCE_DIR OUT_DIR BITS GROUP_SIZE
"""
import shutil
import sys
from pathlib import Path

from mlx_lm.utils import load_model, quantize_model, save_config, save_model


def main():
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    bits, group = int(sys.argv[3]), int(sys.argv[4])
    model, config = load_model(source)
    model, config = quantize_model(model, config, group_size=group, bits=bits)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")


if __name__ == "__main__":
    main()
