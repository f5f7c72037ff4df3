"""How the vLLM CPU worker's RSS grows while vllm-cpu-dsv4 answers one long prompt with top-20 prompt logprobs (issue 39).

    .venv/bin/python benchmarks/probe_prompt_logprobs_memory.py TOKENS [FLAG ...]   # e.g. 6144 prefill_chunk_2048

Why: the 16K decode-after-prefill gate's one-pass prefill (prompt logprobs over prompt + decode) was OOM-killed on a
24 GB box although the 16K decodes themselves ran. One launch; the worker's RSS sampled every 3 s; one JSON line out
(the numbers in benchmarks/results/vllm_prompt_logprobs_memory.json come from two runs of this script).
"""
import json, sys, threading, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import psutil, httpx
from engine.profiles import load_profile
from engine.launcher import EngineServer
from panels import load_tokenizer
from panels.bench import prefill_prompt

n, chunk_flag = int(sys.argv[1]), sys.argv[2:]
tok = load_tokenizer("deepseek")
ids = [int(t) for t in prefill_prompt(tok, n, salt=f"memprobe{n}", chat=False).token_ids]
samples = []
with EngineServer(load_profile("vllm-cpu-dsv4"), flags=chunk_flag) as srv:
    def watch():
        while not done.is_set():
            rss = 0
            for p in psutil.process_iter():
                try:
                    if "VLLM::Worker" in p.name() or "VLLM::Worker" in " ".join(p.cmdline()):
                        rss = max(rss, p.memory_info().rss)
                except psutil.Error:
                    pass
            samples.append((round(time.time() - t0, 1), round(rss / 2**30, 2)))
            time.sleep(3)
    done = threading.Event(); t0 = time.time()
    th = threading.Thread(target=watch, daemon=True); th.start()
    r = httpx.post(srv.base_url + "/v1/completions", json={"model": srv.served_model, "prompt": ids, "max_tokens": 1,
                   "prompt_logprobs": 20, "temperature": 0}, timeout=3600)
    done.set(); th.join()
    print(json.dumps({"tokens": len(ids), "flags": chunk_flag, "status": r.status_code, "seconds": round(time.time() - t0, 1),
                      "peak_worker_gib": max(s[1] for s in samples), "samples": samples}))
