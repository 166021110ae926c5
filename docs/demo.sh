#!/usr/bin/env bash
# The muser lane on the embedded real model, end to end, on this machine.
# Run by `make demo` (which puts the project's virtualenv first on PATH).
set -euo pipefail
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export MUSER_HOME="${MUSER_HOME:-$work/home}"
: "${MUSER_MODELS:=$PWD/tests/.cache/models}"; export MUSER_MODELS
cat > "$work/doc.txt" <<'TXT'
The Rhine is a European river that begins in the Swiss canton of Graubünden in the
southeastern Swiss Alps. It forms part of the Swiss-Liechtenstein, Swiss-Austrian and
Swiss-German borders, then flows through Germany and the Netherlands into the North Sea.
Question: through which countries does the Rhine flow? Answer:
TXT
echo "== producer: prefill | pack > doc.kvpack"
muser prefill -m default "$work/doc.txt" | muser pack --zstd 1 > "$work/doc.kvpack"
ls -l "$work/doc.kvpack" | awk '{print "   kvpack bytes:", $5}'
echo "== consumer: verify | decode (handoff lane)"
muser verify -m default --prompt "$work/doc.txt" "$work/doc.kvpack" -o "$work/verified.kvpack"
muser decode -m default "$work/verified.kvpack" -n 32 --json > "$work/handoff.json"
echo "== consumer without a producer: decode --prompt < /dev/null (fallback lane)"
muser decode -m default --prompt "$work/doc.txt" -n 32 --json < /dev/null > "$work/fallback.json"
python - "$work/handoff.json" "$work/fallback.json" <<'PY'
import json, sys
h, f = (json.load(open(p)) for p in sys.argv[1:3])
print("   handoff text :", h["text"].strip().replace("\n", " "))
print("   fallback text:", f["text"].strip().replace("\n", " "))
print(f"   TTFT handoff {h['ttft_s']*1000:.0f} ms (pack read {h['pack_read_s']*1000:.0f} ms) | "
      f"fallback {f['ttft_s']*1000:.0f} ms (prefill {f['prefill_s']*1000:.0f} ms)")
same = h["token_ids"] == f["token_ids"]
print("   tokens identical:", same)
sys.exit(0 if same else 1)
PY
