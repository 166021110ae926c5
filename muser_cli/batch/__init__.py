"""``muser batch``: a JSONL of prompts on resident engines (docs/batch.md)."""
