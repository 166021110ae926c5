"""Scheduler side of the connector: vLLM's per-step SchedulerOutput -> a JSON save plan.

Each step, for every captured request still in its prompt, one *save item*: the token
range computed this step and the request's block ids per KV cache group. The plan sent
to the workers is one JSON string; nothing of ours is ever unpickled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from muser_cli.engines.vllm.config import CONFIG_KEY, NAME_RE, ConnectorSettings


@dataclass
class _ReqState:
    name: str
    tokens: list[int]
    target: int  # rows to ship: positions [0, target)
    blocks: list[list[int]]
    done: bool = False


def safe_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:128].lstrip("._-")
    return name or "request"


def _request_muser_params(sampling_params: Any) -> dict[str, Any] | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    params = (extra.get("kv_transfer_params") or {}) if isinstance(extra, dict) else {}
    value = params.get(CONFIG_KEY) if isinstance(params, dict) else None
    return value if isinstance(value, dict) else None


class SchedulerPlanner:
    """Scheduler-side bookkeeping: vLLM's per-step SchedulerOutput -> a JSON save plan.

    Duck-typed over vLLM's ``SchedulerOutput`` (``scheduled_new_reqs``,
    ``scheduled_cached_reqs``, ``num_scheduled_tokens``, ``finished_req_ids``).
    """

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self._reqs: dict[str, _ReqState] = {}

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    @property
    def active(self) -> int:
        return len(self._reqs)

    def _item(self, req_id: str, st: _ReqState, start: int, stop: int, reset: bool) -> dict[str, Any] | None:
        final = stop >= st.target
        if start >= st.target and not final:
            return None
        if final:
            st.done = True
        item: dict[str, Any] = {
            "req": req_id, "name": st.name, "start": int(start), "stop": int(min(stop, st.target)), "ran": int(stop),
            "target": st.target, "blocks": [list(map(int, b)) for b in st.blocks],
            "reset": bool(reset), "final": bool(final),
        }
        if final:
            item["tokens"] = list(map(int, st.tokens))
        return item

    def plan(self, scheduler_output: Any) -> str:
        items: list[dict[str, Any]] = []
        for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._reqs.pop(rid, None)
        num_sched: dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        for nr in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            params = _request_muser_params(getattr(nr, "sampling_params", None))
            if params is None and self.settings.capture != "all":
                continue
            rid = str(nr.req_id)
            name = params.get("name") if params else None
            if not (isinstance(name, str) and NAME_RE.match(name)):
                name = safe_name(rid)
            tokens = getattr(nr, "prompt_token_ids", None)
            if tokens is None:
                items.append({"req": rid, "name": name, "error": "request has no prompt token ids (embeddings input)"})
                continue
            tokens = list(tokens)
            target = len(tokens) if self.settings.sink == "spool" else len(tokens) - 1
            st = _ReqState(name=name, tokens=tokens, target=max(target, 0), blocks=[list(b) for b in nr.block_ids])
            self._reqs[rid] = st
            stop = int(nr.num_computed_tokens) + int(num_sched.get(rid, 0))
            # Start at 0 even after a prefix-cache hit: cached blocks hold valid rows.
            item = self._item(rid, st, 0, stop, reset=True)
            if item is not None:
                items.append(item)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed_ids = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, rid in enumerate(cached.req_ids):
                st = self._reqs.get(rid)
                if st is None or st.done:
                    continue
                new_blocks = cached.new_block_ids[i]
                resumed = rid in resumed_ids
                if resumed:  # after preemption the list is the whole table
                    st.blocks = [list(b) for b in (new_blocks or ())]
                elif new_blocks is not None:
                    for g, extra in enumerate(new_blocks):
                        st.blocks[g].extend(extra)
                computed = int(cached.num_computed_tokens[i])
                stop = computed + int(num_sched.get(rid, 0))
                item = self._item(rid, st, 0 if resumed else computed, stop, reset=resumed)
                if item is not None:
                    items.append(item)
        for item in items:
            if item.get("final") or "error" in item:
                self._reqs.pop(item["req"], None)
        return json.dumps({"v": 1, "items": items}, separators=(",", ":"))
