#!/usr/bin/env bash
# The muser lane on the embedded real model, end to end, on this machine, over the wire:
# a consumer and a producer node (each its own MUSER_HOME) onboarded with a private CA,
# the kvpack handed off over mutual TLS 1.3 on 127.0.0.1.
# Run by `make demo` (which puts the project's virtualenv first on PATH).
set -euo pipefail
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
consumer="$work/consumer" producer="$work/producer"
: "${MUSER_MODELS:=$PWD/tests/.cache/models}"; export MUSER_MODELS
model="${DEMO_MODEL:-default}"  # the embedded SmolLM2-135M; the tests run the demo on a tiny model folder
cat > "$work/rhine.txt" <<'TXT'
The Rhine is a European river that begins in the Swiss canton of Graubünden in the
southeastern Swiss Alps. It forms part of the Swiss-Liechtenstein, Swiss-Austrian and
Swiss-German borders, then flows through Germany and the Netherlands into the North Sea.
TXT
{ cat "$work/rhine.txt"; echo "Question: through which countries does the Rhine flow?"; } > "$work/doc.txt"
echo "== onboarding: consumer node init | node export --producer; producer node join"
MUSER_HOME="$consumer" muser -q node init --name consumer
MUSER_HOME="$consumer" muser -q node export --producer producer -o "$work/producer.bundle"
MUSER_HOME="$producer" muser -q node join "$work/producer.bundle"
echo "== consumer: receive --once | verify | decode (listening on 127.0.0.1)"
( MUSER_HOME="$consumer" muser receive --listen 127.0.0.1:0 --once --timeout 300 2> "$work/receive.log" \
  | MUSER_HOME="$consumer" muser verify -m "$model" --chat --prompt "$work/doc.txt" 2> "$work/verify.log" \
  | MUSER_HOME="$consumer" muser decode -m "$model" -n 32 --json > "$work/handoff.json" ) &
lane=$!
for _ in $(seq 100); do grep -q "listening on" "$work/receive.log" 2>/dev/null && break; sleep 0.2; done
addr="$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$work/receive.log")"
echo "== producer: prefill | pack | send --to $addr"
MUSER_HOME="$producer" muser prefill -m "$model" --chat "$work/doc.txt" | muser pack --zstd 1 \
  | MUSER_HOME="$producer" muser send --to "$addr" --json > "$work/send.json"
wait "$lane"
python - "$work/send.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"   sent {s['payload_bytes']} bytes in {s['total_s']*1000:.0f} ms "
      f"(payload rate {s['payload_rate_Bps']/1e6:.0f} MB/s, receiver ledger commit {s['receiver']['ledger_commit_ms']:.1f} ms)")
PY
echo "== consumer without a producer: receive --timeout 2 || decode --prompt (fallback lane, exit 75)"
status=0
MUSER_HOME="$consumer" muser -q receive --listen 127.0.0.1:0 --once --timeout 2 > "$work/none.kvpack" || status=$?
echo "   receive exit status: $status"
test "$status" = 75
MUSER_HOME="$consumer" muser decode -m "$model" --chat --prompt "$work/doc.txt" -n 32 --json < "$work/none.kvpack" > "$work/fallback.json"
python - "$work/handoff.json" "$work/fallback.json" <<'PY'
import json, sys
h, f = (json.load(open(p)) for p in sys.argv[1:3])
print("   handoff text :", h["text"].strip().replace("\n", " "))
print("   fallback text:", f["text"].strip().replace("\n", " "))
same = h["token_ids"] == f["token_ids"]
print("   tokens identical:", same, "(a correctness check, not a speed figure: here the handoff's TTFT,")
print("   counted from the pack's first byte, holds the producer's own prefill on this same machine)")
sys.exit(0 if same else 1)
PY

# The payoff: a consumer whose pack is ready (prefilled elsewhere or earlier) against one that
# prefills the same prompt itself, on a prompt long enough for the prefill to dominate.
python - "$work/long.txt" <<'PY'
import sys
rivers = [("Rhine", "Switzerland, Liechtenstein, Austria, Germany, France and the Netherlands", "North Sea"),
          ("Danube", "Germany, Austria, Slovakia, Hungary, Croatia, Serbia, Romania, Bulgaria and Ukraine", "Black Sea"),
          ("Rhone", "Switzerland and France", "Mediterranean Sea"), ("Elbe", "the Czech Republic and Germany", "North Sea"),
          ("Loire", "France", "Atlantic Ocean"), ("Vistula", "Poland", "Baltic Sea"), ("Po", "Italy", "Adriatic Sea"),
          ("Tagus", "Spain and Portugal", "Atlantic Ocean"), ("Oder", "the Czech Republic, Poland and Germany", "Baltic Sea"),
          ("Dnieper", "Russia, Belarus and Ukraine", "Black Sea"), ("Ebro", "Spain", "Mediterranean Sea"),
          ("Seine", "France", "English Channel")]
lines = [f"Note {i + 1}: the {name} flows through {lands} and ends in the {sea}. Its basin feeds farms, towns "
         f"and industry, and its floods are watched by the countries along it every spring."
         for i, (name, lands, sea) in enumerate(rivers)]
open(sys.argv[1], "w").write("\n".join(lines) + "\nQuestion: which of these rivers end in the Black Sea?\n")
PY
echo "== the payoff, on a longer prompt: decode from a ready pack vs prefill locally (same machine, same tokens)"
MUSER_HOME="$producer" muser -q prefill -m "$model" --chat "$work/long.txt" | muser -q pack --zstd 1 > "$work/long.kvpack"
MUSER_HOME="$consumer" muser -q decode -m "$model" "$work/long.kvpack" -n 16 --json > "$work/ready.json"
MUSER_HOME="$consumer" muser -q decode -m "$model" --chat --prompt "$work/long.txt" -n 16 --json --no-reuse \
  < /dev/null > "$work/local.json"
python - "$work/ready.json" "$work/local.json" <<'PY'
import json, sys
r, l = (json.load(open(p)) for p in sys.argv[1:3])
same = r["token_ids"] == l["token_ids"]
print(f"   {r['prompt_tokens']}-token prompt: TTFT from the ready pack {r['ttft_s']*1000:.0f} ms (read, verify, install, "
      f"first token) | local prefill {l['ttft_s']*1000:.0f} ms: {l['ttft_s'] / r['ttft_s']:.1f}x sooner")
print("   tokens identical:", same)
sys.exit(0 if same else 1)
PY

# The pull lane: the producer stays resident (model loaded once) and the consumer asks it.
{ cat "$work/rhine.txt"; echo "Question: into which sea does the Rhine flow?"; } > "$work/follow.txt"
echo "== producer: prefill --serve (resident); consumer: decode --producer, twice on one document"
MUSER_HOME="$producer" muser prefill --serve 127.0.0.1:0 -m "$model" --json 2> "$work/serve.log" &
serving=$!
for _ in $(seq 300); do grep -q "listening on" "$work/serve.log" 2>/dev/null && break; sleep 0.2; done
paddr="$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$work/serve.log")"
pull=(-m "$model" --chat --chunk 32 -n 32 --json --producer "$paddr")
# The lane itself: ask the producer whatever the cost model predicts. By default
# (MUSER_ROUTE=fastest) a prompt this short stays here, both "machines" being this one.
MUSER_HOME="$consumer" MUSER_ROUTE=producer muser -q decode "${pull[@]}" --prompt "$work/doc.txt" --store \
  > "$work/pull1.json"
MUSER_HOME="$consumer" MUSER_ROUTE=producer muser -q decode "${pull[@]}" --prompt "$work/follow.txt" > "$work/pull2.json"
kill -TERM "$serving"
status=0; wait "$serving" || status=$?
echo "   producer stopped (SIGTERM), exit status $status"
test "$status" = 0
echo "== producer gone: decode --producer falls back by itself"
MUSER_HOME="$consumer" MUSER_ROUTE=producer muser -q decode "${pull[@]}" --prompt "$work/follow.txt" > "$work/pull3.json"
python - "$work/serve.log" "$work/pull1.json" "$work/pull2.json" "$work/pull3.json" <<'PY'
import json, sys
served = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
served = [e for e in served if e.get("event") == "request"]
first, second, gone = (json.load(open(p)) for p in sys.argv[2:5])
for name, run, ev in (("request 1", first, served[0]), ("request 2", second, served[1])):
    print(f"   {name}: source {run['source']:<7} {ev['bytes']:>8} bytes, {ev['shipped_rows']} rows shipped "
          f"({ev['held_rows']} held here), TTFT {run['ttft_s']*1000:.0f} ms | {run['text'].strip()[:60]!r}")
print(f"   fallback : source {gone['source']} ({gone['reason']}), TTFT {gone['ttft_s']*1000:.0f} ms")
same = second["token_ids"] == gone["token_ids"]
print("   follow-up tokens identical (delta vs fallback):", same)
ok = first["source"] == "handoff" and second["source"] == "delta" and gone["fallback"] and same
sys.exit(0 if ok else 1)
PY
