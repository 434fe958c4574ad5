#!/usr/bin/env bash
# vLLM's flags and the generation config's sampling defaults on one GPU, then the API check and the whole GPU suite,
# in one call on nvidia-h200 or nvidia-h100-x1 (carry .whl from `../shared/tools/gpu-wheels.sh anthropic
# docstring-parser jsonschema jsonschema-specifications referencing rpds-py attrs`: the suite's Messages tests import
# anthropic, its grammar conformance tests jsonschema). The shipped model at --tp 1 with CUDA graphs:
#   1. served as it is: the lane pool and prompt cache it plans, the GPU's memory in use, gpu_api_check.py, and
#      Anthropic's Messages API against the chat (scripts/messages_check.py);
#   2. served from a vLLM command line (--gpu-memory-utilization 0.3, --speculative-config, the parser flags, the
#      flags taken as they are, priority scheduling and load tracking) with
#      --override-generation-config '{"temperature": 0, "max_new_tokens": 6}': its pool, cache and memory in use, and
#      a chat without temperature or max_tokens against one asking for greedy and 6 tokens (token_sha, usage);
#   3. --gpu-memory-utilization 0.01: refused at start naming the flag, or served with less (its log says which);
#   4. PYTEST=1 (default): `pytest -m gpu tests` within what is left of SUITE_S (default 280) seconds.
# Usage, from the repo root there:  OUT=... bash scripts/gpu_flags_check.sh   (logs under $OUT)
set -u
: "${OUT:?set OUT to the folder for logs}"
source scripts/gpu_serve.sh
pick_model
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader

used_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
planned() { grep -h "lane pool\|serving \|CUDA graphs:\|sampling defaults\|utilization" "$1" | sed 's/^.*INFO //'; }

if serve_until_up 200 8601 "$OUT/serve_plain.log" "${model_args[@]}"; then
  echo "plain: up $(since); GPU memory in use $(used_mib) MiB"; planned "$OUT/serve_plain.log"
  timeout 200 python3 scripts/gpu_api_check.py --base-url http://127.0.0.1:8601 > "$OUT/api_check.out" 2>&1
  echo "api check rc=$? $(since): $(grep -c PASS "$OUT/api_check.out") PASS, $(grep -c FAIL "$OUT/api_check.out") FAIL"
  grep FAIL "$OUT/api_check.out" | head -5
  python3 scripts/messages_check.py --base-url http://127.0.0.1:8601/v1
else
  echo "plain: did not come up"; tail -5 "$OUT/serve_plain.log"
fi
stop_server

vllm_line=(--gpu-memory-utilization 0.3 --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
  --trust-remote-code --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'
  --override-generation-config '{"temperature": 0, "max_new_tokens": 6}' --enable-expert-parallel --async-scheduling
  --kv-cache-dtype auto --enable-chunked-prefill --scheduling-policy priority --enable-server-load-tracking)
if serve_until_up 200 8602 "$OUT/serve_vllm.log" "${model_args[@]}" "${vllm_line[@]}"; then
  echo "vllm line: up $(since); GPU memory in use $(used_mib) MiB"; planned "$OUT/serve_vllm.log"
  python3 - <<'EOF'
import httpx
url = "http://127.0.0.1:8602/v1/chat/completions"
ask = {"messages": [{"role": "user", "content": "Write a sorting function."}], "ignore_eos": True}
unset = httpx.post(url, json=ask, timeout=120).json()
greedy = httpx.post(url, json={**ask, "temperature": 0, "max_tokens": 6}, timeout=120).json()
capped = httpx.post(url, json={**ask, "temperature": 0, "max_tokens": 20, "priority": -1}, timeout=120).json()
print("load after the answers:", httpx.get("http://127.0.0.1:8602/load").json())
print("unset:", unset["usage"]["completion_tokens"], "tokens", unset["token_sha"][:16])
print("greedy, 6:", greedy["usage"]["completion_tokens"], "tokens", greedy["token_sha"][:16])
print("asked 20 under the override's cap of 6:", capped["usage"]["completion_tokens"], "tokens")
same = unset["token_sha"] == greedy["token_sha"] and unset["usage"]["completion_tokens"] == 6
print("defaults served:", "yes" if same and capped["usage"]["completion_tokens"] == 6 else "NO")
EOF
else
  echo "vllm line: did not come up"; tail -5 "$OUT/serve_vllm.log"
fi
stop_server

if serve_until_up 200 8603 "$OUT/serve_tiny.log" "${model_args[@]}" --gpu-memory-utilization 0.01; then
  echo "utilization 0.01: served $(since)"
else
  echo "utilization 0.01: not served $(since)"; grep -h "gpu-memory-utilization" "$OUT/serve_tiny.log"
fi
planned "$OUT/serve_tiny.log"
stop_server

if [ "${PYTEST:-1}" = 1 ]; then
  left=$(( ${SUITE_S:-280} ))
  TRITON_INTERPRET=0 timeout "$left" python3 -m pytest -q -m gpu tests -p no:randomly -p no:cacheprovider \
    > "$OUT/pytest_gpu.out" 2>&1
  echo "pytest -m gpu rc=$? $(since)"; tail -3 "$OUT/pytest_gpu.out"
fi
