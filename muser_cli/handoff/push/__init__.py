"""The push lane: a producer sends (:mod:`.sender`), a consumer receives, verifies as it
streams and publishes (:mod:`.receiver`, :mod:`.spool`, :mod:`.payload`, :mod:`.receipt`)."""
