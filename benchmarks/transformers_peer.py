"""The naive peer: transformers' `generate` on the same synthetic weights as
`--load-format dummy` (the same tensors, by name), greedy, fixed output length.

    python benchmarks/transformers_peer.py --model benchmarks/models/llama-3.1-8b \
        --out benchmarks/results/transformers_peer_llama8b.json
"""

from __future__ import annotations

import argparse
import time

import torch
from common import report

from kubesgl.engine.model_config import load_model_config
from kubesgl.engine.models.weights import synthetic_checkpoint


def build(model_path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in synthetic_checkpoint(
            load_model_config(model_path), 0, torch.bfloat16, "cuda"
        ):
            params[name].copy_(tensor)
    return model.eval()


def run(model, batch: int, input_len: int, output_len: int) -> dict:
    ids = torch.randint(10, 120000, (batch, input_len), device="cuda")
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
        torch.cuda.synchronize()
        assert out.shape[1] == input_len + n
        return time.perf_counter() - start

    generate(4)
    first = generate(1)
    total = generate(output_len)
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "ms_per_decode_step": (total - first) / (output_len - 1) * 1e3,
        "output_tokens_per_s": batch * output_len / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import transformers

    model = build(args.model)
    result = {
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(),
        "runs": [run(model, 1, 128, 512), run(model, 64, 512, 256)],
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
