"""The wire, sans-IO: the Handoff V3 frames and state table (:mod:`.protocol`), the pull
lane's request/answer exchange (:mod:`.pull_protocol`), the MAC'd header and trailer
(:mod:`.header`), and what a peer's Reject code means (:mod:`.refusal`). Bytes in, events
out: no sockets, no files."""
