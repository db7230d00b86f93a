#!/usr/bin/env python3
"""Run llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist, not from this repository) on
a BF16 DeepSeek-V3 checkpoint made by `cachalot convert --quant-mode bfloat16`, writing arch `deepseek2` GGUF
with MLA (the converter splits kv_b_proj into k_b/v_b and writes kv_lora_rank, key/value_length_mla, etc.).

The one change: the vocabulary. Our random benchmark models carry a small fixture tokenizer whose pre-tokenizer
hash llama.cpp does not know, so the converter's set_vocab would refuse; both benchmarks feed random token
ids, so we write a synthetic byte-level "gpt2" vocabulary of vocab_size tokens (the 256 byte symbols, then
<tok_N> fillers) and a single merge (llama.cpp refuses a BPE vocabulary without a merges list). Nothing else of
the converter is touched.

Usage: gguf_convert.py --llama-src DIR/vendor/llama.cpp --model BF16_DIR --outtype bf16|q8_0 --outfile F.gguf
"""

import argparse
import sys
from pathlib import Path


def byte_symbols():
    """GPT-2's byte -> printable unicode map (the byte-level BPE alphabet), from transformers."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    m = bytes_to_unicode()
    return [m[b] for b in range(256)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-src", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--outtype", choices=["bf16", "q8_0", "f16", "f32"], required=True)
    ap.add_argument("--outfile", type=Path, required=True)
    a = ap.parse_args()
    src = a.llama_src.resolve()
    sys.path.insert(0, str(src / "gguf-py"))
    sys.path.insert(0, str(src))
    import gguf  # noqa: E402  (the sdist's gguf-py, matching its converter)
    import convert_hf_to_gguf  # noqa: E402
    from conversion.deepseek import DeepseekV2Model  # noqa: E402

    def set_vocab(self):
        n = int(self.hparams["vocab_size"])
        syms = byte_symbols()
        tokens = (syms + [f"<tok_{i}>" for i in range(len(syms), n)])[:n]
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("default")
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
        self.gguf_writer.add_token_merges([f"{syms[ord('a')]} {syms[ord('b')]}"])
        self.gguf_writer.add_bos_token_id(int(self.hparams.get("bos_token_id", 0)))
        self.gguf_writer.add_eos_token_id(int(self.hparams.get("eos_token_id", 1)))
        self.gguf_writer.add_add_bos_token(False)

    DeepseekV2Model.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", str(a.model), "--outtype", a.outtype, "--outfile", str(a.outfile)]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
