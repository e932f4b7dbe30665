"""S3 mode of scripts/bench.py (``--dir s3://bucket/prefix``): nxd_ckpt against boto3's own transfer manager.

In one run, on the same tensors: nxd_ckpt's synchronous save (call to `done` acknowledged) and load (until
the device holds the tensors), and the peer: every tensor file's bytes (as nxd_ckpt wrote them) uploaded with
``boto3``'s ``upload_fileobj`` and downloaded with ``download_fileobj`` (its default TransferConfig) on
``--num-workers`` threads. Throughput = state bytes / seconds. The endpoint comes from ``--endpoint-url`` or
the AWS environment (``AWS_ENDPOINT_URL_S3``); S3 request counts per save come from nxd_ckpt's client.
"""
from __future__ import annotations

import io
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def run_s3(args, build_state, xla) -> dict:
    import torch

    import nxd_ckpt
    from nxd_ckpt.storage import open_storage

    if args.endpoint_url:
        os.environ["AWS_ENDPOINT_URL_S3"] = args.endpoint_url
    torch_xla, xm = xla()
    dev = torch_xla.device()
    model, optim, _ = build_state(int(args.size_gb * 1e9), args.tensors, dev, args.state)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    storage = open_storage(args.dir, workers=args.num_workers)
    rounds = []
    for r in range(args.repeat + 1):
        tag = f"bench_{r}"
        before = dict(storage.bucket.requests)
        t0 = time.monotonic()
        nxd_ckpt.save_checkpoint(args.dir, tag, model=model, num_workers=args.num_workers, num_kept_ckpts=1)
        save_s = time.monotonic() - t0
        requests = {k: v - before.get(k, 0) for k, v in storage.bucket.requests.items() if v - before.get(k, 0)}
        target = {k: torch.empty_like(v) for k, v in model.items()}
        before = dict(storage.bucket.requests)
        t0 = time.monotonic()
        nxd_ckpt.load_checkpoint(args.dir, tag=tag, model=target, num_workers=args.num_workers)
        torch_xla.sync()
        load_s = time.monotonic() - t0
        load_requests = {k: v - before.get(k, 0) for k, v in storage.bucket.requests.items() if v - before.get(k, 0)}
        peer_up, peer_down = _peer(storage, tag, args.num_workers)
        row = {"save_s": save_s, "load_s": load_s, "peer_upload_s": peer_up, "peer_download_s": peer_down,
               "requests_per_save": requests, "requests_per_load": load_requests,
               "loadavg_1min": os.getloadavg()[0]}
        print(f"  round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(
            f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, float)) + f", requests={requests}, "
            f"load requests={load_requests}", flush=True)
        if r:
            rounds.append(row)
    med = {k: statistics.median(x[k] for x in rounds) for k in ("save_s", "load_s", "peer_upload_s", "peer_download_s")}
    out = {"bytes": nbytes, "dir": args.dir, "rounds": rounds, "median": med,
           "save_gbps": nbytes / med["save_s"] / 1e9, "load_gbps": nbytes / med["load_s"] / 1e9,
           "peer_upload_gbps": nbytes / med["peer_upload_s"] / 1e9,
           "peer_download_gbps": nbytes / med["peer_download_s"] / 1e9,
           "requests_per_save": rounds[-1]["requests_per_save"],
           "requests_per_load": rounds[-1]["requests_per_load"]}
    out["targets"] = [
        ("nxd_ckpt save GB/s >= 0.9 x boto3 upload_fileobj GB/s", out["save_gbps"], 0.9 * out["peer_upload_gbps"]),
        ("nxd_ckpt load GB/s >= nxd_ckpt save GB/s", out["load_gbps"], out["save_gbps"]),
    ]
    return out


def _peer(storage, tag: str, workers: int):
    """boto3's transfer manager on the same objects' bytes: upload_fileobj to a peer prefix, then
    download_fileobj back; (upload seconds, download seconds)."""
    bucket = storage.bucket
    keys = [k for k in storage.list(tag) if ".tensors/" in k or k.endswith(".pt")]
    blobs = {k: storage.read(k) for k in keys}
    client = bucket.client
    peer = [(f"{storage.key('peer')}/{k}", data) for k, data in blobs.items()]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        t0 = time.monotonic()
        list(pool.map(lambda kv: client.upload_fileobj(io.BytesIO(kv[1]), bucket.name, kv[0]), peer))
        up = time.monotonic() - t0
        t0 = time.monotonic()
        list(pool.map(lambda kv: client.download_fileobj(bucket.name, kv[0], io.BytesIO()), peer))
        down = time.monotonic() - t0
    storage.remove_tree("peer")
    return up, down


def print_s3(out: dict) -> None:
    gb = out["bytes"] / 1e9
    print(f"{gb:.3f} GB to {out['dir']}: nxd_ckpt save {out['save_gbps']:.3f} GB/s, load {out['load_gbps']:.3f} GB/s; "
          f"boto3 upload_fileobj {out['peer_upload_gbps']:.3f} GB/s, download_fileobj {out['peer_download_gbps']:.3f} GB/s")
    print(f"S3 requests per save: {out['requests_per_save']}")
    if "requests_per_load" in out:
        print(f"S3 requests per load: {out['requests_per_load']}")
    for name, value, bound in out["targets"]:
        print(f"  [{'MET ' if value >= bound else 'MISS'}] {name}: {value:.3f} vs {bound:.3f}")


def markdown_s3(out: dict) -> str:
    """The README's table of an S3 run's JSON (``scripts/bench.py --markdown``; runs before the load's request
    counts and load averages were recorded print without them)."""
    med, gb = out["median"], out["bytes"] / 1e9
    la = [x["loadavg_1min"] for x in out["rounds"] if "loadavg_1min" in x]
    lines = [f"**{gb:.3f} GB to `{out['dir']}`**, {len(out['rounds'])} round(s) after a warm-up (medians)"
             + (f", 1-minute load average {min(la):.1f} to {max(la):.1f}" if la else ""), "",
             "| | nxd_ckpt save | nxd_ckpt load | boto3 `upload_fileobj` | boto3 `download_fileobj` |",
             "|---|---|---|---|---|",
             "| median s | " + " | ".join(f"{med[k]:.2f}" for k in ("save_s", "load_s", "peer_upload_s",
                                                                      "peer_download_s")) + " |",
             "| GB/s | " + " | ".join(f"{out[k]:.3f}" for k in ("save_gbps", "load_gbps", "peer_upload_gbps",
                                                                 "peer_download_gbps")) + " |",
             "", "| target | value | bound | met |", "|---|---|---|---|"]
    for name, value, bound in out["targets"]:
        lines.append(f"| {name} | {value:.3f} | {bound:.3f} | {'yes' if value >= bound else '**no**'} |")
    for what in ("save", "load"):
        if f"requests_per_{what}" in out:
            made = ", ".join(f"{v} {k}" for k, v in out[f"requests_per_{what}"].items())
            lines += ["", f"S3 requests per {what}: {made}."]
    return "\n".join(lines) + "\n"
