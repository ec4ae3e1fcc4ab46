#!/usr/bin/env python3
"""cublas_shapes.py: the GEMMs cuBLAS runs for each T=4096 case of the
grid at the case's own shapes, balanced (every expert T k / E rows), as
peers.py's cuBLAS bmm reference runs them; for ncu to name and time
(device.sh's cublas step):

  ncu --metrics gpu__time_duration.sum -k "regex:nvjet|gemm" \\
      python3 kernels/bench/cublas_shapes.py

Each case: its gate/up bmm and its down bmm, twice each.
"""
import torch

# (name, E, k, H, I): peers.py's MODELS
SHAPES = [
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("deepseek-v3", 256, 8, 7168, 2048),
]
T = 4096


def main():
    for name, E, k, H, I in SHAPES:
        m = T * k // E
        bf = dict(dtype=torch.bfloat16, device="cuda")
        x = torch.randn(E, m, H, **bf)
        a = torch.randn(E, m, I, **bf)
        w13t = torch.randn(E, 2 * I, H, **bf).transpose(1, 2)
        w2t = torch.randn(E, H, I, **bf).transpose(1, 2)
        for _ in range(2):
            torch.bmm(x, w13t)
            torch.bmm(a, w2t)
        torch.cuda.synchronize()
        print(f"# {name}: E {E}, {m} rows an expert, H {H}, I {I}", flush=True)
        del x, a, w13t, w2t


if __name__ == "__main__":
    main()
