#!/usr/bin/env python3
"""peers.py: the peers moed's CUDA kernels are measured against, timed on the
same card in the same run as bench_moe, in the BENCH.md grid.

  python3 kernels/bench/peers.py [--out FILE] [--only MODEL] [--tokens T]
  python3 kernels/bench/peers.py --shapes

Two peers, each a whole bf16 MoE layer (softmax top-k routing with
renormalisation included), captured in a CUDA graph per input set, four
rotating input sets, median of per-replay event times:

  triton      a vLLM-style fused_moe written here: routing with torch ops, the
              expert alignment (moe_align_block_size) as device-only torch ops,
              one Triton grouped GEMM for gate/up over the sorted token ids,
              SiLU*mul, one for down times the routing weight, a sum over k.
              Block sizes: the best of two candidate configurations per
              regime (tokens per expert), as vLLM's tuned tables would pick.
  grouped_mm  torch._grouped_mm over expert-sorted rows (FBGEMM style).

At T=4096 also BENCH.md's per-expert cuBLAS loop on rows already sorted
and balanced, and, as a reference rather than a peer, the same work as two
strided-batched cuBLAS calls (torch.bmm over [E, T*k/E, H]): what cuBLAS
reaches at the case's own GEMM shapes, with no routing, no imbalance and
no launch per expert. Each bmm's rate alone is printed too. --shapes runs
only those GEMMs, twice each and untimed, for ncu to name (device.sh's
cublas step).

Writes "model T triton_us grouped_us loop_us bmm_us" lines (-1: failed or
not run) to --out, which
bench_moe --peers reads, and prints a table. The two peers are checked
against each other on input set 0; report.py joins this file with
bench_moe --csv into the report table.
"""
import argparse
import math
import sys

import torch
import triton
import triton.language as tl

MODELS = [
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("deepseek-v3", 256, 8, 7168, 2048),
]
TOKENS = [1, 8, 64, 512, 4096]
NSETS = 4
LOOP_TOKENS = 4096  # the per-expert cuBLAS loop runs at prefill only


@triton.jit
def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, expert_ids_ptr,
                    num_post_ptr, N, K, EM, num_valid,
                    stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                    stride_cm, stride_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    TOP_K: tl.constexpr, MUL_W: tl.constexpr,
                    A_PER_TOKEN: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    group_id = pid // in_group
    first_m = group_id * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % group_m)
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_tok = tl.load(sorted_ids_ptr + offs_m)
    tok_mask = offs_tok < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    if A_PER_TOKEN:
        a_rows = (offs_tok // TOP_K).to(tl.int64)
    else:
        a_rows = offs_tok.to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (b_ptr + expert * stride_be + offs_k[:, None] * stride_bk +
              offs_n[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=tok_mask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_W:
        w = tl.load(w_ptr + offs_tok, mask=tok_mask, other=0.0)
        acc = acc * w[:, None]
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = (c_ptr + offs_tok.to(tl.int64)[:, None] * stride_cm +
              offs_cn[None, :] * stride_cn)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=tok_mask[:, None] & (offs_cn[None, :] < N))


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per regime.
CONFIGS = {
    "decode": [(16, 64, 128, 1, 4, 4), (16, 128, 64, 1, 4, 4)],
    "mid": [(32, 128, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3)],
    "large": [(64, 128, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3)],
}


def route(logits, k):
    scores = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(scores, k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def align(ids, E, bm):
    """moe_align_block_size with device-only torch ops (graph-capturable)."""
    flat = ids.flatten()
    S = flat.numel()
    dev = flat.device
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    cum = torch.cumsum(padded, 0)
    starts = cum - padded
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    ccum = torch.cumsum(counts, 0) - counts
    rank = torch.arange(S, device=dev) - ccum[sorted_e]
    dest = starts[sorted_e] + rank
    EM = S + E * (bm - 1)
    sorted_ids = torch.full((EM,), S, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    nblk = (EM + bm - 1) // bm
    blk = torch.arange(nblk, device=dev) * bm
    expert_ids = torch.searchsorted(cum, blk, right=True).clamp_(max=E - 1)
    return sorted_ids, expert_ids.to(torch.int32), cum[-1:].to(torch.int32), EM


def triton_moe(x, logits, w13, w2, k, cfg):
    T, H = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    bm, bn, bk, gm, nw, ns = cfg
    w, ids = route(logits, k)
    sorted_ids, expert_ids, num_post, EM = align(ids, E, bm)
    S = T * k
    wf = w.flatten().contiguous()
    inter = torch.empty((S, I2), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(EM, bm) * triton.cdiv(I2, bn),)
    moe_gemm_kernel[grid](x, w13, inter, wf, sorted_ids, expert_ids, num_post,
                          I2, H, EM, S, x.stride(0), x.stride(1),
                          w13.stride(0), w13.stride(1), w13.stride(2),
                          inter.stride(0), inter.stride(1),
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                          TOP_K=k, MUL_W=False, A_PER_TOKEN=True,
                          num_warps=nw, num_stages=ns)
    act = torch.nn.functional.silu(inter[:, :I]) * inter[:, I:]
    y = torch.empty((S, H), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(EM, bm) * triton.cdiv(H, bn),)
    moe_gemm_kernel[grid](act, w2, y, wf, sorted_ids, expert_ids, num_post,
                          H, I, EM, S, act.stride(0), act.stride(1),
                          w2.stride(0), w2.stride(1), w2.stride(2),
                          y.stride(0), y.stride(1),
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                          TOP_K=1, MUL_W=True, A_PER_TOKEN=False,
                          num_warps=nw, num_stages=ns)
    return y.view(T, k, H).sum(dim=1)


def grouped_mm_moe(x, logits, w13t, w2t, k):
    T, H = x.shape
    E = w13t.shape[0]
    I = w13t.shape[2] // 2
    w, ids = route(logits, k)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = order // k
    xs = x[tok]
    h = torch._grouped_mm(xs, w13t, offs=offs)
    a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, w2t, offs=offs)
    y = y.float() * w.flatten()[order][:, None]
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out.to(x.dtype)


def cublas_loop(xs, w13, w2, I):
    """The prefill peer of BENCH.md: one cuBLAS GEMM pair per expert on
    rows already sorted and balanced (xs: [E, m, H]); no routing, alignment
    or combine."""
    ys = []
    for e in range(xs.shape[0]):
        h = xs[e] @ w13[e].t()
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        ys.append(a @ w2[e].t())
    return ys


def cublas_bmm(xs, w13t, w2t, I):
    """The loop's work in two strided-batched GEMMs (xs: [E, m, H])."""
    h = torch.bmm(xs, w13t)
    a = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
    return torch.bmm(a, w2t)


def expert_weights(E, H, I, dev):
    """The layer's weights, scaled so activations stay near 1: w13 [E, 2I,
    H] (gate and up) and w2 [E, H, I]."""
    w13 = torch.randn((E, 2 * I, H), dtype=torch.bfloat16, device=dev)
    w13.mul_(1.0 / math.sqrt(H))
    w2 = torch.randn((E, H, I), dtype=torch.bfloat16, device=dev)
    w2.mul_(1.0 / math.sqrt(I))
    return w13, w2


def balanced_rows(E, m, H, dev, n=NSETS):
    """n input sets of m rows an expert, already sorted: [E, m, H]."""
    return [torch.rand((E, m, H), device=dev).mul_(2).sub_(1)
            .to(torch.bfloat16) for _ in range(n)]


def time_bmm(name, T, xl, w13t, w2t, I):
    """cublas_bmm's us over the sets xl; each bmm's us and rate alone are
    printed."""
    E, m, H = xl[0].shape
    bmm_us = time_graphs([lambda x=x: cublas_bmm(x, w13t, w2t, I) for x in xl])
    al = balanced_rows(E, m, I, xl[0].device)
    us1 = time_graphs([lambda x=x: torch.bmm(x, w13t) for x in xl])
    us2 = time_graphs([lambda a=a: torch.bmm(a, w2t) for a in al])
    f1, f2 = 2.0 * E * m * H * 2 * I, 2.0 * E * m * I * H
    print(f"# cublas bmm {name} T={T}: gate/up {us1:.1f} us "
          f"({f1 / us1 / 1e6:.1f} TFLOP/s), down {us2:.1f} us "
          f"({f2 / us2 / 1e6:.1f} TFLOP/s), both with SiLU*mul "
          f"{bmm_us:.1f} us", flush=True)
    return bmm_us


def bmm_shapes(dev):
    """--shapes: cublas_bmm twice per LOOP_TOKENS case of MODELS, untimed,
    for ncu to name and time its kernels (device.sh's cublas step)."""
    for name, E, k, H, I in MODELS:
        m = LOOP_TOKENS * k // E
        x = balanced_rows(E, m, H, dev, 1)[0]
        w13, w2 = expert_weights(E, H, I, dev)
        for _ in range(2):
            cublas_bmm(x, w13.transpose(1, 2), w2.transpose(1, 2), I)
        torch.cuda.synchronize()
        print(f"# {name}: E {E}, {m} rows an expert, H {H}, I {I}", flush=True)
        del x, w13, w2


def time_graphs(fns, budget_ms=300.0):
    """Capture fns (one per input set) in graphs; median us per replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm up: compile, allocate
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graphs = []
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs.append(g)
    for i in range(3 * len(graphs)):
        graphs[i % len(graphs)].replay()
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    for g in graphs:
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    est = e0.elapsed_time(e1) / len(graphs)
    n = int(min(1000, max(16, budget_ms / max(est, 1e-3))))
    ev = [(torch.cuda.Event(enable_timing=True),
           torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for i in range(n):
        ev[i][0].record()
        graphs[i % len(graphs)].replay()
        ev[i][1].record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1000.0 for a, b in ev)
    return t[len(t) // 2]


def regime(T, k, E):
    hit = E * (1.0 - (1.0 - k / E) ** T)
    m = T * k / max(hit, 1.0)
    return "decode" if m <= 8 else "mid" if m <= 64 else "large"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="peers.txt")
    ap.add_argument("--only")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--shapes", action="store_true",
                    help="only run the cuBLAS bmm reference's GEMMs, untimed")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    if args.shapes:
        bmm_shapes(dev)
        return
    print(f"# device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    rows = []
    for name, E, k, H, I in MODELS:
        if args.only and args.only != name:
            continue
        w13, w2 = expert_weights(E, H, I, dev)
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
        for T in TOKENS:
            if args.tokens and args.tokens != T:
                continue
            xs = [torch.rand((T, H), device=dev).mul_(2).sub_(1).to(torch.bfloat16)
                  for _ in range(NSETS)]
            ls = [torch.rand((T, E), device=dev).mul_(2).sub_(1)
                  for _ in range(NSETS)]
            tri_us, best_cfg, tri_out = -1.0, None, None
            for cfg in CONFIGS[regime(T, k, E)]:
                try:
                    fns = [lambda x=x, l=l, c=cfg: triton_moe(x, l, w13, w2, k, c)
                           for x, l in zip(xs, ls)]
                    us = time_graphs(fns)
                    if tri_us < 0 or us < tri_us:
                        tri_us, best_cfg = us, cfg
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"# triton {name} T={T} cfg={cfg}: {e!r}"[:300],
                          file=sys.stderr, flush=True)
            try:
                if best_cfg:
                    tri_out = triton_moe(xs[0], ls[0], w13, w2, k, best_cfg)
            except Exception:  # noqa: BLE001
                tri_out = None
            gro_us, gro_out = -1.0, None
            try:
                fns = [lambda x=x, l=l: grouped_mm_moe(x, l, w13t, w2t, k)
                       for x, l in zip(xs, ls)]
                gro_us = time_graphs(fns)
                gro_out = grouped_mm_moe(xs[0], ls[0], w13t, w2t, k)
            except Exception as e:  # noqa: BLE001
                print(f"# grouped_mm {name} T={T}: {e!r}"[:300],
                      file=sys.stderr, flush=True)
            loop_us, bmm_us = -1.0, -1.0
            if T == LOOP_TOKENS and T * k % E == 0:
                m, xl = T * k // E, None
                try:
                    xl = balanced_rows(E, m, H, dev)
                    fns = [lambda x=x: cublas_loop(x, w13, w2, I) for x in xl]
                    loop_us = time_graphs(fns)
                except Exception as e:  # noqa: BLE001
                    print(f"# cublas loop {name} T={T}: {e!r}"[:300],
                          file=sys.stderr, flush=True)
                if xl is not None:
                    try:
                        bmm_us = time_bmm(name, T, xl, w13t, w2t, I)
                    except Exception as e:  # noqa: BLE001
                        print(f"# cublas bmm {name} T={T}: {e!r}"[:300],
                              file=sys.stderr, flush=True)
                del xl
            agree = float("nan")
            if tri_out is not None and gro_out is not None:
                d = (tri_out.float() - gro_out.float()).norm()
                agree = (d / gro_out.float().norm()).item()
            rows.append((name, T, tri_us, gro_us, loop_us, bmm_us))
            print(f"| {name} | {T} | {tri_us:.1f} | {best_cfg} | {gro_us:.1f} "
                  f"| {loop_us:.1f} | {bmm_us:.1f} | {agree:.1e} |", flush=True)
            del xs, ls
        del w13, w2, w13t, w2t
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write("# model T triton_us grouped_mm_us cublas_loop_us cublas_bmm_us\n")
        for r in rows:
            f.write(f"{r[0]} {r[1]} {r[2]:.2f} {r[3]:.2f} {r[4]:.2f} {r[5]:.2f}\n")


if __name__ == "__main__":
    main()
