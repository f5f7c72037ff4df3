#!/usr/bin/env bash
# The once-off full task-eval comparison of docs/EVALS.md: full HumanEval (164) and IFEval (541) on
# vLLM CPU fp32 and llama.cpp Q4_1 (SmolLM2-135M), the paired comparison, then the IFEval-reply KL panel
# built from the fp32 oracle's own replies and scored on both engines. Every step resumes: rerun the
# script after a crash and it continues where it stopped.
#   OUT=results/evals-full nohup bash scripts/evals-full-run.sh > evals-full.log 2>&1 &
# PROFILES="vllm-cpu-fp32 llama-server-q4_1" (baseline first); caps: HumanEval 128, IFEval 40 tokens (what
# finished on the shared 2-core box in docs/EVALS.md; raise them on a quiet machine).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-results/evals-full}"
he_tokens="${HUMANEVAL_MAX_TOKENS:-128}"
if_tokens="${IFEVAL_MAX_TOKENS:-40}"
profiles="${PROFILES:-vllm-cpu-fp32 llama-server-q4_1}"
panel_prompts="${PANEL_PROMPTS:-30}"
panel_tokens="${PANEL_TOKENS:-48}"
mkdir -p "$out"
stamp() { date -u +%H:%M:%S; }
set -- $profiles
for profile in "$@"; do
  echo "[$(stamp)] eval on $profile (HumanEval <= $he_tokens tokens, IFEval <= $if_tokens)"
  .venv/bin/ds41gate eval humaneval --engine-profile "$profile" --out "$out/$profile" \
    --max-tokens "$he_tokens" --concurrency 32 --no-progress
  .venv/bin/ds41gate eval ifeval --engine-profile "$profile" --out "$out/$profile" \
    --max-tokens "$if_tokens" --concurrency 48 --no-progress
done
echo "[$(stamp)] paired comparison"
.venv/bin/ds41gate eval-compare "$out/$1" "$out/$2" --out "$out"
if [ ! -f panels/data/ifeval-replies-1.manifest.json ]; then
  echo "[$(stamp)] IFEval-reply panel: $panel_prompts oracle replies, <= $panel_tokens tokens"
  .venv/bin/ds41gate ifeval-panel --n-prompts "$panel_prompts" --max-new-tokens "$panel_tokens"
fi
echo "[$(stamp)] KL on the IFEval-reply panel, both engines"
.venv/bin/ds41gate demo --panel ifeval-replies --profile "$1" --profile "$2" \
  --out "$out/kl-ifeval-replies" --replace-results || echo "(demo exit $?: a KL band verdict failed; the report is written)"
echo "[$(stamp)] done"
