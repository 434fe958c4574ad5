# Shared by the GPU scripts (source it from the repo root on the GPU machine): the environment, the carried
# wheels, and `serve_until_up SECONDS PORT LOG ARGS...`, which starts `python3 -m server ARGS` with a time limit and
# waits until /health answers (SERVER holds its pid; returns 1 if it died or never came up).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:.

serve_until_up() {
  local limit=$1 port=$2 log=$3
  shift 3
  timeout "$limit" python3 -m server --host 127.0.0.1 --port "$port" "$@" > "$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 300); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" \
      2>/dev/null && return 0
    kill -0 $SERVER 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

stop_server() {
  kill $SERVER 2>/dev/null
  sleep 3
  pkill -9 -f "m server" 2>/dev/null
}
