"""The server under tensor parallelism on the CPU: torchrun of 2 gloo ranks, `--tp 2`; rank 0 serves HTTP
and rank 1 follows its steps (Engine(broadcast_plans=True), engine.follow()), with prefix caching and n-gram
speculation (a prompt whose first new tokens repeat its first ones, so that drafts are verified: /metrics counts
them). Greedy completions (one alone, the same again from the prefix cache, two at once) give the tokens of the
one-process Engine.generate without speculation; SIGTERM to rank 0 ends every rank and torchrun with exit code 0,
and the port is free."""

import os
import re
import signal
import sys
import threading

import httpx
import pytest
import torch

from metrale_graph import Engine, HybridModel
from server_process import ServerProcess, free_port, port_is_free
from tokenizer_fixture import tiny_checkpoint

TIMEOUT = 180


def test_tp_server_matches_one_process_and_ends_on_sigterm(tmp_path):
    checkpoint = tiny_checkpoint(tmp_path / "ckpt")
    port = free_port()
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
                "--master-port", str(free_port())]
    server = ServerProcess(["-m", "metrale_graph.tools.serve", "--model", checkpoint, "--tp", "2", "--device", "cpu",
                            "--eager", "--num-slots", "4", "--max-context", "128", "--prefix-cache", "--port", str(port),
                            "--shutdown-timeout", "2", "--speculative-config", "ngram"], port, tmp_path, launcher=torchrun)
    try:
        # the second's first tokens are its first three (one process, greedy): prompt lookup finds them and drafts
        prompts = [[1, 2, 3], [194, 386, 121, 11, 150, 230, 49, 200]]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        model = HybridModel.from_pretrained(checkpoint, progress=False)  # (while the ranks start)
        with Engine(model, num_slots=4, max_context=128, compile=False) as engine:
            want = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6)]
        torch.set_num_threads(threads)
        server.wait_healthy(TIMEOUT)
        got, cached = [None, None], [None, None]

        def ask(i):
            r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT,
                           json={"prompt": prompts[i], "max_tokens": 6, "temperature": 0, "return_token_ids": True})
            got[i] = r.json()["choices"][0]["token_ids"]
            cached[i] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        ask(0)
        assert got[0] == want[0] and cached[0] == 0
        ask(0)  # all but its last token from the prefix cache, on both ranks
        assert got[0] == want[0] and cached[0] == len(prompts[0]) - 1
        clients = [threading.Thread(target=ask, args=(i,)) for i in range(2)]  # continuous batching across ranks
        for t in clients:
            t.start()
        for t in clients:
            t.join(TIMEOUT)
        assert got == want
        drafts = re.search(r"^metrale_spec_decode_num_drafts_total\{[^}]*\} (\S+)$",
                           httpx.get(server.url + "/metrics", timeout=TIMEOUT).text, re.M)
        assert drafts and float(drafts.group(1)) > 0
        rank0 = int(re.search(r"\(pid (\d+)\)", open(server.out_path).read()).group(1))
        os.kill(rank0, signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.output()
        assert port_is_free(port)
        assert '"tool": "serve"' in open(server.out_path).read().strip().splitlines()[-1]
    except BaseException:
        print(server.output())
        raise
    finally:
        server.stop()


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
