"""The producer's side of the lane: ``prefill`` (a prompt on the canonical schedule into a
kvpack), the one pipeline every producer uses (pipeline: a header, rows from ordered row
sources, one writer), and ``pack`` (re-encode a kvpack frame by frame: codec, quantization,
delta).

Nothing is imported here; each verb is imported from its own module."""
