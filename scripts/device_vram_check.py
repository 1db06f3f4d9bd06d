"""Quick check on a GPU machine before `kvlink bench transfer --memory cuda`: versions, then
two kvlink `NixlAgent`s with mem_type VRAM in this process; one READs a torch CUDA tensor of
the other and the bytes are compared on the host. Exits 1 with the reason if anything fails.

    PYTHONPATH=src UCX_NET_DEVICES=lo python3 scripts/device_vram_check.py
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import os
import sys
import time
import uuid


def versions() -> None:
    import torch

    from kvlink.transfer import nixl_import

    dist = nixl_import.PACKAGE_NAME.replace("_", "-")
    print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"NIXL package {nixl_import.PACKAGE_NAME} {importlib.metadata.version(dist)}")
    if torch.cuda.is_available():
        print(f"CUDA device 0: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
    libs = os.path.join(os.path.dirname(os.path.dirname(nixl_import.api.__file__)),
                        f"{nixl_import.PACKAGE_NAME}.libs")
    for path in glob.glob(os.path.join(libs, "libucp-*.so*"))[:1]:
        ucp = ctypes.CDLL(path)
        ucp.ucp_get_version_string.restype = ctypes.c_char_p
        print(f"UCX {ucp.ucp_get_version_string().decode()} ({os.path.basename(path)}); "
              f"UCX modules: {sorted(f.split('.')[0] for f in os.listdir(os.path.join(libs, 'ucx')) if '.so' in f)}")


def vram_read(nbytes: int = 64 << 20) -> None:
    import torch

    from kvlink.transfer.agent import NixlAgent

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: torch.cuda.is_available() is False")
    src = torch.arange(nbytes, dtype=torch.int64, device="cuda:0").to(torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    tag = uuid.uuid4().hex[:6]
    with NixlAgent(f"check-src-{tag}", mem_type="VRAM") as a, NixlAgent(f"check-dst-{tag}", mem_type="VRAM") as b:
        a.register_regions([(src.data_ptr(), nbytes)], device_id=0)
        b.register_regions([(dst.data_ptr(), nbytes)], device_id=0)
        peer = b.add_remote(a.metadata())
        a.add_remote(b.metadata())
        local = b.prep_local([[dst.data_ptr(), nbytes, 0]])
        remote = b.prep_remote(peer, [[src.data_ptr(), nbytes, 0]])
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            transfer = b.post("READ", local, [0], remote, [0])
            while b.poll(transfer) != "DONE":
                a.get_notifs()
            times.append(time.perf_counter() - t0)
            b.release(transfer)
    same = bool(torch.equal(src.cpu(), dst.cpu()))
    best = sorted(times)[len(times) // 2]
    print(f"VRAM -> VRAM READ in one process, {nbytes >> 20} MiB: median {best * 1e3:.2f} ms "
          f"({nbytes / best / 1e9:.1f} GB/s, first {times[0] * 1e3:.2f} ms); bytes equal: {same}")
    if not same:
        raise SystemExit("VRAM READ moved the wrong bytes")


if __name__ == "__main__":
    versions()
    vram_read()
