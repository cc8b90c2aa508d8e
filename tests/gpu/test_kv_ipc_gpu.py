"""Same-host KV transfer over CUDA IPC (``workers.transfer.kv_ipc``) between two ``mesh worker`` processes
on the GPU(s): the decode worker copies the prefill worker's pages GPU to GPU under a read lease,
and its greedy output equals a mixed worker's, token for token. With ``--kv-transfer-ipc off``
the same requests take the TCP pull (the fallback) and give the same output.

Needs the gateway's packages (fastapi, uvicorn, httpx: the device runs carry them as wheels).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.disagg_cluster import Cluster, completion, direct, prompt_tokens, relay, status  # noqa: E402
from tests.procs import ProcessGroup  # noqa: E402

DEVICES = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
GPU = ("--num-kv-blocks", "2048")  # room for 3k-token prompts under the inbound bound (half the cache)


@pytest.mark.parametrize("ipc", ["auto", "off"])
def test_decode_copies_kv_from_a_same_host_peer_and_stays_greedy_equal(tmp_path, ipc: str) -> None:  # type: ignore[no-untyped-def]
    group = ProcessGroup(tmp_path)
    try:
        c = Cluster(group)
        c.start("p0", "prefill", "--device", DEVICES[0], *GPU, faults=False)
        c.start("d0", "decode", "--device", DEVICES[1], "--kv-transfer-ipc", ipc, *GPU, faults=False)
        c.start("m", "mixed", "--device", DEVICES[0], *GPU, faults=False)
        c.wait()
        router = c.router()
        prompts = [prompt_tokens(3000, seed=7), prompt_tokens(3000, seed=7)[:2000] + prompt_tokens(900, seed=8)]
        for i, prompt in enumerate(prompts):
            body = completion(prompt, 24, stream=bool(i % 2))
            got = asyncio.run(relay(router, body))
            assert got.status == 200
            assert got.text == direct(c.workers["m"].url, body)[0]
        d, p = status(c.workers["d0"].url), status(c.workers["p0"].url)
        assert d["decode_blocks_pulled"] > 0
        if ipc == "auto":
            assert d["decode_blocks_copied_ipc"] == d["decode_blocks_pulled"]
        else:
            assert d["decode_blocks_copied_ipc"] == 0
        # exactly-once on both sides: nothing pinned or leaked once the requests are done
        assert d["leaked_blocks"] == 0 and p["leaked_blocks"] == 0
        assert d["pinned_blocks"] == 0
    finally:
        group.stop_all()
