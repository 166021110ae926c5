"""Two or three examples per command, shown at the end of its ``--help``, man page and
docs/cli.md section (as git's and curl's EXAMPLES are): what it does, then the line.

Keyed by the command path after ``muser``; keep each line under 76 characters so that an
80-column terminal shows it unbroken, and use only options the command has
(tests/cli/test_cli_polish.py checks both).
"""

from __future__ import annotations

EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "prefill": [
        ("Prefill a document and keep its KV, compressed, in a file:",
         "muser prefill -m default doc.txt | muser pack > doc.kvpack"),
        ("Stream it to an enrolled consumer as the chunks finish:",
         "muser prefill doc.txt | muser send --to consumer:7070"),
        ("Run a resident producer that enrolled consumers pull from:",
         "muser prefill --serve 0.0.0.0:7070 -m default"),
    ],
    "pack": [
        ("Compress a pack (every frame verified first):",
         "muser pack --zstd 3 raw.kvpack -o doc.kvpack"),
        ("Describe a pack without writing anything:",
         "muser pack --info doc.kvpack"),
        ("Ship only what the consumer's store lacks (a delta):",
         "muser pack --have have.json doc.kvpack -o delta.kvpack"),
    ],
    "send": [
        ("Hand a prompt's KV to a consumer as it is computed:",
         "muser prefill doc.txt | muser send --to consumer:7070"),
        ("Send a pack from a file, capped at 100 MB/s:",
         "muser send doc.kvpack --to consumer:7070 --rate 100M"),
    ],
    "receive": [
        ("Accept one handoff and decode it, verified on the way:",
         "muser receive --listen :7070 --once | muser verify | muser decode"),
        ("Wait at most 30 s for a handoff (exit 75 if none came):",
         "muser receive --listen :7070 --once --timeout 30 -o doc.kvpack"),
        ("Pull a prompt's KV from a resident producer:",
         "muser receive --from gx10:7070 doc.txt -o doc.kvpack"),
    ],
    "verify": [
        ("Check a pack against the prompt it claims to be of:",
         "muser verify -m default --prompt doc.txt doc.kvpack"),
        ("The report as JSON, for a script:",
         "muser verify --json doc.kvpack"),
        ("Between receive and decode: pass on only verified bytes:",
         "muser receive --listen :7070 --once | muser verify | muser decode"),
    ],
    "decode": [
        ("Decode 64 tokens from a pack:",
         "muser decode -m default doc.kvpack -n 64"),
        ("No pack: prefill locally on the same schedule (same tokens):",
         "muser decode -m default --prompt doc.txt -n 64 < /dev/null"),
        ("Pull the KV from a resident producer, falling back by itself:",
         "muser decode --producer gx10:7070 --prompt doc.txt"),
    ],
    "reuse": [
        ("Keep a pack's KV in this machine's store:",
         "muser reuse put doc.kvpack"),
        ("What the store holds of a prompt (for `pack --have`):",
         "muser reuse have -m default doc2.txt > have.json"),
        ("List the entries, then trim the store to 10 GiB:",
         "muser reuse ls && muser reuse gc --max-size 10G"),
    ],
    "batch": [
        ("Run a jobs file locally, one model load for all of them:",
         "muser batch jobs.jsonl -m default -o results.jsonl"),
        ("Pull the KV from a resident producer:",
         "muser batch jobs.jsonl --producer gx10:7070 -o results.jsonl"),
        ("After a crash: finish what is left, redo nothing:",
         "muser batch jobs.jsonl -o results.jsonl --resume"),
    ],
    "node": [
        ("On the consumer: an identity, then a bundle for producer gx10:",
         "muser node init && muser node export --producer gx10 -o gx10.bundle"),
        ("On the producer: join with that bundle:",
         "muser node join gx10.bundle"),
        ("On the consumer: is the producer ready to serve?",
         "muser node check gx10:7070"),
    ],
    "probe-link": [
        ("Measure the link to a consumer both ways:",
         "muser probe-link consumer:7070"),
        ("Fail (exit 75) below 50 MB/s, for a script:",
         "muser probe-link consumer:7070 --floor 50M"),
    ],
    "bench": [
        ("Time to first token by prompt depth, with a chart:",
         "muser bench lane --depths 512,2048,8064 --plot ttft.png"),
        ("The kvpack codec against mlx-lm and memcpy:",
         "muser bench pack --depths 2048 --plot pack.png"),
        ("Throughput by payload size over loopback TLS:",
         "muser bench wire --sizes 1,8,64 --plot wire.png"),
    ],
}


def epilog(path: str) -> str | None:
    """The examples of ``path`` as the end of its ``--help`` (Rich keeps these line breaks)."""
    items = EXAMPLES.get(path)
    if not items:
        return None
    lines = ["[b]Examples[/b]"]
    for what, line in items:
        lines += ["", _escape(what), "  $ " + _escape(line)]
    return "\n".join(lines)


def _escape(text: str) -> str:
    """Rich reads ``[...]`` as markup; an example's brackets are literal."""
    return text.replace("[", "\\[")
