#!/usr/bin/env bash
# Demonstrates "one fused op = one folder": in a temporary copy of this checkout, delete one op
# (default RMSNormGrad) with its folder, its rules, its own test module, the samples that exist
# only for its pattern and the per-pattern counts of its pattern in the sample / corpus
# manifests, then build the library and run the tests there.
# Nothing outside those names the op, so the build and the tests pass without it.
#
#   scripts/check_op_removal.sh                 RMSNormGrad, a CPU-only build, the core tests
#   FULL=1 scripts/check_op_removal.sh          the whole suite (tests fusecli/ops)
#   OP=layer_norm_grad PATTERN=layernorm RULES='layernorm_*' OWN_TESTS='' scripts/check_op_removal.sh
#
# Needs `make venv ortt-env` (the copy uses this checkout's .venv and .venv-ortt, with the copy
# first on PYTHONPATH) and build/deps (scripts/fetch_deps.sh). The copy is deleted afterwards
# (KEEP=1 keeps it). Tests named after the removed pattern (-k "not PATTERN") are its own tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OP=${OP:-rms_norm_grad}
PATTERN=${PATTERN:-rmsnorm}
RULES=${RULES:-rmsnorm_*}
OWN_TESTS=${OWN_TESTS:-tests/test_rmsnorm.py}
cd "$ROOT"
[[ -d fusecli/ops/$OP ]] || { echo "check_op_removal: no fusecli/ops/$OP" >&2; exit 2; }
[[ -x .venv/bin/python ]] || { echo "check_op_removal: run 'make venv ortt-env' first" >&2; exit 2; }
NAME=$(.venv/bin/python -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['name'])" \
       "fusecli/ops/$OP/contract.yaml")

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fusecli-removal.XXXXXX")
[[ ${KEEP:-0} == 1 ]] || trap 'rm -rf "$WORK"' EXIT
COPY="$WORK/fusecli"
mkdir -p "$COPY"
# the working tree as git sees it (tracked + untracked, not ignored), plus what the build needs
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [[ -e $f ]] && printf '%s\0' "$f"; done | tar --null -T - -cf - | tar -xf - -C "$COPY"
mkdir -p "$COPY/build"
ln -s "$ROOT/build/deps" "$COPY/build/deps"
ln -s "$ROOT/.venv" "$COPY/.venv"
ln -s "$ROOT/.venv-ortt" "$COPY/.venv-ortt"

echo "== removing $NAME: fusecli/ops/$OP, rules/$RULES, $OWN_TESTS, '$PATTERN' counts in manifests"
cd "$COPY"
rm -rf "fusecli/ops/$OP"
# shellcheck disable=SC2086
rm -f rules/$RULES $OWN_TESTS
.venv/bin/python - "$PATTERN" samples/manifest.yaml corpus/manifest.yaml <<'PY'
import re, sys
from pathlib import Path
pattern, files = sys.argv[1], sys.argv[2:]
for f in files:  # drop "<pattern>: N" lines; a count block left empty becomes {}
    lines = [ln for ln in Path(f).read_text().splitlines()
             if not re.fullmatch(rf" +{re.escape(pattern)}: \d+", ln)]
    for i, ln in enumerate(lines):
        m = re.fullmatch(r"( +)(?:patterns|expected):", ln)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m and len(nxt) - len(nxt.lstrip()) <= len(m.group(1)):
            lines[i] = ln + " {}"
    if f.startswith("samples/"):  # a sample that exists only for this pattern is its sample
        out, drop = [], False
        for i, ln in enumerate(lines):
            m = re.fullmatch(r"  (\w+):", ln)
            if m:
                block = lines[i + 1:]
                end = next((k for k, x in enumerate(block) if re.fullmatch(r"  \w+:", x)),
                           len(block))
                drop = "    patterns: {}" in block[:end]
                if drop:
                    for path in Path("samples").glob(m.group(1) + ".*"):
                        print(f"   sample {path} (only {pattern})")
                        path.unlink()
            if not drop:
                out.append(ln)
        lines = out
    Path(f).write_text("\n".join(lines) + "\n")
PY

echo "== what still names it outside docs (*.md) and sample/corpus generators:"
LEFT=$(git grep -n --no-index -I -e "$NAME" -e "$OP" -e "\\b$PATTERN\\b" -- . \
       ':!*.md' ':!scripts/samples' ':!scripts/corpus' ':!scripts/check_op_removal.sh' ':!build' ':!.venv' \
       ':!.venv-ortt' ':!samples/*.onnx' ':!corpus/*.onnx' || true)
if [[ -n $LEFT ]]; then echo "$LEFT"; else echo "   (nothing)"; fi

echo "== build (CPU kernels; FUSECLI_CUDA=${FUSECLI_CUDA:-0})"
FUSECLI_CUDA=${FUSECLI_CUDA:-0} bash scripts/build_lib.sh
export PYTHONPATH="$COPY"
.venv/bin/python -c "import fusecli, sys; from fusecli import CANONICAL_PATTERNS as P
assert fusecli.__file__.startswith(sys.argv[1]), fusecli.__file__
assert sys.argv[2] not in P, P
print('   fusecli from the copy; patterns:', ', '.join(P))" "$COPY" "$PATTERN"

if [[ ${FULL:-0} == 1 ]]; then
  TESTS=(tests fusecli/ops)
else
  TESTS=(tests/test_contracts.py tests/test_op_folders.py tests/test_kernels.py tests/test_rules.py
         tests/test_cli.py tests/test_samples.py tests/test_optimize_samples.py
         tests/test_variants.py fusecli/ops)
fi
echo "== pytest ${TESTS[*]} -k 'not $PATTERN'"
.venv/bin/python -m pytest -q -x -p no:cacheprovider "${TESTS[@]}" -k "not $PATTERN"
echo "== $NAME removed: build and tests pass without it"
