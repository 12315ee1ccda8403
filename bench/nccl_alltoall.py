#!/usr/bin/env python3
"""Baseline (b) of issue #3: MoE dispatch and combine the way users do it today with
torch.distributed.all_to_all_single and split sizes on the host, one process per GPU (NCCL backend).

Per rank, every timed dispatch iteration does:
  1. quant    fused FP8 quantization of x (f32_g128, as SEMANTICS.md; skipped for --payload bf16);
  2. counts   the tokens it sends to each rank (a token goes to a rank once, whatever number of its top-k
              experts live there), an all_to_all_single of the counts, then .tolist() of send and receive
              counts: the host split sizes;
  3. pack     one wire message per (token, destination rank), laid out as ElasticEP's (src/core/layout.hpp):
              [fp8 row][fp32 scales][topk idx int32][topk weights fp32][source token int32], 16-byte fields;
  4. a2a      all_to_all_single(recv, send, output_split_sizes, input_split_sizes).
Every combine iteration:
  1. a2a      all_to_all_single of one bf16 row per received message back to its origin (the splits of the
              dispatch, reversed; the expert-side weighted sum that makes those partials is not timed);
  2. reduce   at the origin, partials summed per token in order of first appearance of their rank in the
              top-k row, in fp32, rounded to bf16 (SEMANTICS.md combine steps 3-4).
The receive-side expansion into the expert-contiguous layout is not included (ElasticEP's dispatch does it).

Timing: an L2 flush, a barrier and a device synchronize before every iteration, CUDA events between the
steps; per iteration the slowest rank's time, median over iterations. GB/s = bytes of messages to other
ranks, all ranks together (as `elasticep bench`'s peer GB/s), over the median.

Launch: torchrun --nproc-per-node 2 bench/nccl_alltoall.py [options]
        python bench/nccl_alltoall.py --spawn 2 [options]
        python bench/nccl_alltoall.py --spawn 2 --device cpu [options]   (gloo, to test the logic without GPUs)
NCCL_NVLS_ENABLE=0 is set before NCCL initialises (NVLink SHARP multicast off).
"""
from __future__ import annotations

import os

_NVLS_BEFORE = os.environ.get("NCCL_NVLS_ENABLE")
os.environ["NCCL_NVLS_ENABLE"] = "0"  # before torch / NCCL initialise; inherited by spawned workers

import argparse  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

DISPATCH_STEPS = ["quant", "counts", "pack", "a2a"]
COMBINE_STEPS = ["a2a", "reduce"]


class Marks:
    """n + 1 time stamps around n steps: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device, n):
        self.cuda = device.type == "cuda"
        self.n = n
        if self.cuda:
            self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        self.t = [0.0] * (n + 1)

    def mark(self, i):
        if self.cuda:
            self.ev[i].record()
        else:
            self.t[i] = time.perf_counter()

    def steps_us(self):
        if self.cuda:
            self.ev[-1].synchronize()
            return [self.ev[i].elapsed_time(self.ev[i + 1]) * 1e3 for i in range(self.n)]
        return [(self.t[i + 1] - self.t[i]) * 1e6 for i in range(self.n)]


class Rank:
    def __init__(self, args, rank, world, device, tokens):
        self.rank, self.world, self.device = rank, world, device
        self.T, self.H, self.E, self.K = tokens, args.hidden, args.experts, args.topk
        if self.E % world:
            raise SystemExit(f"--experts {self.E} is not a multiple of the world size {world}")
        self.El = self.E // world
        self.fp8 = args.payload == "fp8"
        self.cols = self.H // bc.SCALE_GROUP if self.fp8 else 0
        elem = 1 if self.fp8 else 2
        self.payload_bytes = bc.round_up(self.H * elem, 16)
        self.scale_off = self.payload_bytes
        self.idx_off = self.scale_off + bc.round_up(self.cols * 4, 16)
        self.w_off = self.idx_off + bc.round_up(self.K * 4, 16)
        self.src_off = self.w_off + bc.round_up(self.K * 4, 16)
        self.msg = self.src_off + 16
        assert self.msg == bc.message_bytes(self.H, self.K, elem, self.cols)
        self.J = min(self.K, world)
        self.c448 = torch.tensor(bc.E4M3_MAX, dtype=torch.float32, device=device)

        idx, w = bc.make_routing(rank, tokens, self.E, self.K, skew=args.skew, drop=args.drop, seed=args.seed)
        self.idx = torch.from_numpy(idx).to(device)
        self.idx32 = self.idx.to(torch.int32)
        self.w = torch.from_numpy(w).to(device)
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed * 1000003 + rank)
        self.x = (torch.randn(tokens, self.H, generator=gen, device=device)).to(torch.bfloat16)
        self.src_tok = torch.arange(tokens, dtype=torch.int32, device=device)

    # ---------------------------------------------------------------------------------------------- dispatch
    def dispatch(self, marks: Marks):
        T, H, W = self.T, self.H, self.world
        marks.mark(0)
        if self.fp8:
            xf = self.x.float().view(T, self.cols, bc.SCALE_GROUP)
            amax = xf.abs().amax(dim=-1).clamp_min_(bc.AMAX_FLOOR)
            scales = amax / self.c448
            q = xf.mul_((self.c448 / amax).unsqueeze(-1)).to(torch.float8_e4m3fn).view(T, H).view(torch.uint8)
        else:
            q = self.x.view(torch.uint8)
            scales = None
        marks.mark(1)
        valid = self.idx >= 0
        dest = torch.where(valid, torch.div(self.idx, self.El, rounding_mode="floor"), W)
        to_rank = torch.zeros(T, W + 1, dtype=torch.bool, device=self.device)
        to_rank.scatter_(1, dest, True)
        to_rank = to_rank[:, :W]
        send_counts = to_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_split = send_counts.tolist()  # host sync: the split sizes, as users do
        recv_split = recv_counts.tolist()
        marks.mark(2)
        pairs = torch.nonzero(to_rank.t())  # (dest, token), dest-major: the send order
        tok = pairs[:, 1]
        n_send = tok.numel()
        send = torch.empty(n_send, self.msg, dtype=torch.uint8, device=self.device)
        send[:, :H * (1 if self.fp8 else 2)] = q.index_select(0, tok)
        if self.fp8:
            send[:, self.scale_off:self.scale_off + self.cols * 4] = scales.index_select(0, tok).view(torch.uint8)
        send[:, self.idx_off:self.idx_off + self.K * 4] = self.idx32.index_select(0, tok).view(torch.uint8)
        send[:, self.w_off:self.w_off + self.K * 4] = self.w.index_select(0, tok).view(torch.uint8)
        send[:, self.src_off:self.src_off + 4] = self.src_tok.index_select(0, tok).view(torch.uint8).view(-1, 4)
        recv = torch.empty(sum(recv_split), self.msg, dtype=torch.uint8, device=self.device)
        marks.mark(3)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_split, input_split_sizes=send_split)
        marks.mark(4)
        return recv, (send_split, recv_split, pairs)

    def combine_plan(self, pairs):
        """Partial row of each returned message: token * J + slot, the slot being the index of its rank among
        the token's destination ranks in order of first appearance in the top-k row (made at dispatch time)."""
        T, K, W, J = self.T, self.K, self.world, self.J
        dest = torch.where(self.idx >= 0, torch.div(self.idx, self.El, rounding_mode="floor"), -1)
        eq = (dest.unsqueeze(2) == dest.unsqueeze(1)) & (dest.unsqueeze(1) >= 0)
        first_k = eq.to(torch.int8).argmax(dim=2)
        is_first = (first_k == torch.arange(K, device=self.device)) & (dest >= 0)
        slot_of_first = torch.cumsum(is_first.to(torch.int64), 1) - 1  # [T, K]
        slot_of_rank = torch.full((T, W + 1), -1, dtype=torch.int64, device=self.device)
        slot_of_rank.scatter_(1, torch.where(is_first, dest, W), torch.where(is_first, slot_of_first, -1))
        d, t = pairs[:, 0], pairs[:, 1]
        prow = t * J + slot_of_rank[t, d]
        used = torch.arange(J, device=self.device).view(1, J) < is_first.sum(1).view(T, 1)
        return prow, used

    # ----------------------------------------------------------------------------------------------- combine
    def combine(self, marks: Marks, y, splits, plan):
        send_split, recv_split, _ = splits
        prow, used = plan
        T, H, J = self.T, self.H, self.J
        marks.mark(0)
        back = torch.empty(sum(send_split), H, dtype=torch.bfloat16, device=self.device)
        dist.all_to_all_single(back, y, output_split_sizes=send_split, input_split_sizes=recv_split)
        marks.mark(1)
        part = torch.full((T, J, H), -0.0, dtype=torch.bfloat16, device=self.device)  # -0.0 adds nothing
        part.masked_fill_(used.unsqueeze(-1), 0.0)
        part.view(T * J, H).index_copy_(0, prow, back)
        acc = torch.zeros(T, H, dtype=torch.float32, device=self.device)
        for j in range(J):
            acc.add_(part[:, j])
        out = acc.to(torch.bfloat16)
        marks.mark(2)
        return out


def reduce_iters(per_iter_steps, device):
    """[iters][total, steps...] of this rank -> the same of the slowest rank (per column), on every rank."""
    t = torch.tensor([[sum(r)] + list(r) for r in per_iter_steps], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def phase_stats(steps_names, rows):
    return {name: bc.stats([r[i] for r in rows]) for i, name in enumerate(["total"] + steps_names)}


def check_round(args, rk, device):
    """One dispatch + combine checked against values regenerated independently for every source rank:
    the received messages (tokens, order, fp8 rows, scales, idx, weights, source token) and the combined rows.
    Returns the number of mismatches on this rank."""
    fails = []
    marks = Marks(device, len(DISPATCH_STEPS))
    recv, splits = rk.dispatch(marks)
    send_split, recv_split, pairs = splits
    recv = recv.cpu()
    pop = bc.expert_popularity(rk.E, args.skew, args.seed)
    c448 = torch.tensor(bc.E4M3_MAX, dtype=torch.float32, device=device)
    at = 0
    y = torch.empty(recv.shape[0], rk.H, dtype=torch.float32)
    hh = torch.arange(rk.H)
    value = lambda origin, t, d: (((t * 7 + d * 3 + origin * 5) + hh) % 64 - 32).float() * 2.0 ** -4  # noqa: E731
    for s in range(rk.world):
        idx, w = bc.make_routing(s, rk.T, rk.E, rk.K, skew=args.skew, drop=args.drop, seed=args.seed, popularity=pop)
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed * 1000003 + s)
        x = torch.randn(rk.T, rk.H, generator=gen, device=device).to(torch.bfloat16)
        toks = [t for t in range(rk.T) if any(e >= 0 and e // rk.El == rk.rank for e in idx[t])]
        if recv_split[s] != len(toks):
            fails.append(f"from rank {s}: {recv_split[s]} messages, want {len(toks)}")
            at += recv_split[s]
            continue
        if rk.fp8:
            q, sc = bc.quantize_f32_g128(x, c448)
            q, sc = q.view(torch.uint8).cpu(), sc.cpu()
        else:
            q = x.view(torch.uint8).cpu()
        for i, t in enumerate(toks):
            m = recv[at + i]
            ok = torch.equal(m[:rk.H * (1 if rk.fp8 else 2)], q[t])
            if rk.fp8:
                ok &= torch.equal(m[rk.scale_off:rk.scale_off + rk.cols * 4].view(torch.float32), sc[t])
            ok &= m[rk.idx_off:rk.idx_off + rk.K * 4].view(torch.int32).tolist() == idx[t].tolist()
            ok &= np.array_equal(m[rk.w_off:rk.w_off + rk.K * 4].view(torch.float32).numpy(), w[t])
            ok &= m[rk.src_off:rk.src_off + 4].view(torch.int32).item() == t
            if not ok:
                fails.append(f"from rank {s}: message {i} (token {t}) differs")
            y[at + i] = value(s, t, rk.rank)
        at += len(toks)
    cm = Marks(device, len(COMBINE_STEPS))
    y_dev = y.to(torch.bfloat16).to(device)
    out = rk.combine(cm, y_dev, splits, rk.combine_plan(pairs)).float().cpu()
    my_idx = rk.idx.cpu().tolist()
    for t in range(rk.T):
        want = torch.zeros(rk.H)
        dests = []
        for e in my_idx[t]:
            if e >= 0 and e // rk.El not in dests:
                dests.append(e // rk.El)
        for d in dests:
            want += value(rk.rank, t, d)  # exact: multiples of 2^-4 below 16 in magnitude
        if not torch.equal(out[t], want):
            fails.append(f"combine token {t}: got {out[t][:4].tolist()} want {want[:4].tolist()}")
    for f in fails[:5]:
        print(f"rank {rk.rank} CHECK FAIL {f}", flush=True)
    return len(fails)


def barrier(device):
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
        torch.cuda.synchronize(device)
    else:
        dist.barrier()


def run_phase(args, rank, world, device, shape):
    rk = Rank(args, rank, world, device, shape.tokens)
    flush = bc.L2Flush(device, 0 if args.no_flush else 256 << 20)
    dm, cm = Marks(device, len(DISPATCH_STEPS)), Marks(device, len(COMBINE_STEPS))
    d_rows, c_rows = [], []
    y = plan = None
    checked = None
    if args.check:
        bad = torch.tensor([check_round(args, rk, device)], dtype=torch.int64, device=device)
        dist.all_reduce(bad)
        checked = int(bad.item()) == 0
        if rank == 0:
            print(f"check T={shape.tokens}: " + ("dispatch messages and combined rows equal the regenerated values "
                                                 "on every rank" if checked else f"{int(bad.item())} MISMATCHES"))
    for it in range(args.warmup + args.iters):
        flush()
        barrier(device)
        recv, splits = rk.dispatch(dm)
        d_steps = dm.steps_us()
        if y is None:  # stand-in partials: one bf16 row per received message (made once, untimed)
            y = torch.randn(recv.shape[0], rk.H, device=device).to(torch.bfloat16)
            plan = rk.combine_plan(splits[2])
        del recv
        flush()
        barrier(device)
        rk.combine(cm, y, splits, plan)
        c_steps = cm.steps_us()
        if it >= args.warmup:
            d_rows.append(d_steps)
            c_rows.append(c_steps)
    d_rows = reduce_iters(d_rows, device)
    c_rows = reduce_iters(c_rows, device)

    send_split = splits[0]
    peer_local = torch.tensor([sum(send_split) - send_split[rank], send_split[rank]], dtype=torch.int64,
                              device=device)
    dist.all_reduce(peer_local)
    peer, local = (int(v) for v in peer_local.cpu().tolist())
    res = {"phase": shape.name, "tokens_per_rank": shape.tokens, "peer_messages": peer, "local_messages": local,
           "message_bytes": rk.msg, "dispatch": phase_stats(DISPATCH_STEPS, d_rows),
           "combine": phase_stats(COMBINE_STEPS, c_rows), "checked": checked}
    for op, nbytes in (("dispatch", peer * rk.msg), ("combine", peer * rk.H * 2)):
        res[op]["peer_bytes"] = nbytes
        for step in res[op].values():
            if isinstance(step, dict):
                step["peer_gbps"] = nbytes / (step["median_us"] * 1e3) if step["median_us"] > 0 else None
    return res


def worker(rank, world, args, local_rank=None):
    local_rank = rank if local_rank is None else local_rank
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no GPU here: use --device cpu (gloo) to test the logic")
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"rank {rank} needs GPU {local_rank}, only {torch.cuda.device_count()} visible: "
                             "one GPU per rank")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        try:
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        except TypeError:  # torch < 2.3 has no device_id
            dist.init_process_group("nccl", rank=rank, world_size=world)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = []
        if rank == 0:
            nvls = "" if _NVLS_BEFORE in (None, "0") else f" (was {_NVLS_BEFORE})"
            print(f"torch.distributed all_to_all_single with host split sizes: {world} ranks, backend "
                  f"{dist.get_backend()}, {bc.device_name(device)}, torch {torch.__version__}"
                  + (f", NCCL {nccl_version()}" if device.type == "cuda" else "")
                  + f", NCCL_NVLS_ENABLE=0{nvls}")
            print(f"H={args.hidden} E={args.experts} K={args.topk} payload={args.payload} skew={args.skew} "
                  f"seed={args.seed} iters={args.iters} warmup={args.warmup} "
                  f"L2 flush={'off' if args.no_flush else 'on'}")
            print(f"{'phase':8} {'T/rank':>6} {'op':8} {'step':7} {'median us':>10} {'min us':>10} {'GB/s':>9}")
        for shape in bc.phases_from(args.tokens):
            res = run_phase(args, rank, world, device, shape)
            results.append(res)
            if rank == 0:
                for op, steps in (("dispatch", ["total"] + DISPATCH_STEPS), ("combine", ["total"] + COMBINE_STEPS)):
                    for step in steps:
                        st = res[op][step]
                        gb = f"{st['peer_gbps']:9.1f}" if step in ("total", "a2a") and st["peer_gbps"] else ""
                        print(f"{shape.name:8} {shape.tokens:6} {op:8} {step:7} {st['median_us']:10.1f} "
                              f"{st['min_us']:10.1f} {gb}")
                print(f"{'':15} messages to peers {res['peer_messages']}, to self {res['local_messages']}, "
                      f"{res['message_bytes']} B each")
        if rank == 0 and args.json:
            bc.write_json(args.json, {
                "bench": "nccl_alltoall", "world_size": world, "backend": dist.get_backend(),
                "device": bc.device_name(device), "torch": torch.__version__,
                "nccl": nccl_version() if device.type == "cuda" else None,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                "hidden": args.hidden, "experts": args.experts, "topk": args.topk, "payload": args.payload,
                "skew": args.skew, "seed": args.seed, "iters": args.iters, "warmup": args.warmup,
                "l2_flush": not args.no_flush, "phases": results})
            if args.json != "-":
                print(f"wrote {args.json}")
        barrier(device)
    finally:
        dist.destroy_process_group()
    if any(r["checked"] is False for r in results):
        sys.exit(1)


def nccl_version():
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _spawn_entry(rank, world, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    worker(rank, world, args)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spawn", type=int, default=0, help="start N ranks with torch.multiprocessing (no torchrun)")
    ap.add_argument("--tokens", default="128,4096",
                    help="tokens per rank, comma-separated phases (default 128,4096 = decode,prefill)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--payload", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--skew", type=float, default=0.8)
    ap.add_argument("--drop", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", "--iters", dest="iters", type=int, default=20, help="timed rounds (as elasticep bench)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-flush", action="store_true", help="skip the L2 flush between iterations")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="cuda = NCCL, one GPU per rank (default when a GPU is present); cpu = gloo")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                    help="rank 0 writes the results as JSON to FILE (stdout without FILE)")
    ap.add_argument("--check", action="store_true",
                    help="first verify one dispatch + combine against regenerated values (exit code 1 on mismatch)")
    args = ap.parse_args(argv)
    bc.check_json_path(args.json)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.payload == "fp8" and args.hidden % bc.SCALE_GROUP:
        raise SystemExit(f"--hidden {args.hidden} is not a multiple of {bc.SCALE_GROUP}")
    if not 1 <= args.topk <= min(32, args.experts):
        raise SystemExit("--topk must be in [1, min(32, experts)]")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not args.spawn:  # torchrun
        world = int(os.environ["WORLD_SIZE"])
        if world < 2:
            raise SystemExit("needs at least 2 ranks (torchrun --nproc-per-node 2 ...)")
        worker(int(os.environ["RANK"]), world, args, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        return 0
    if args.spawn < 2:
        raise SystemExit("launch with torchrun --nproc-per-node N (N >= 2) or pass --spawn N (N >= 2)")
    if args.device == "cuda" and torch.cuda.device_count() < args.spawn:
        raise SystemExit(f"--spawn {args.spawn} needs {args.spawn} GPUs (one per rank), "
                         f"{torch.cuda.device_count()} visible")
    import torch.multiprocessing as mp

    try:
        mp.spawn(_spawn_entry, args=(args.spawn, args, free_port()), nprocs=args.spawn, join=True)
    except mp.ProcessExitedException as e:
        print(f"a rank failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
