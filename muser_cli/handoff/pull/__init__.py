"""The pull lane's sockets: the consumer asks (:mod:`.client`), the resident producer
answers (:mod:`.server`, its admission in :mod:`.admission`). The exchange itself is
:mod:`muser_cli.handoff.wire.pull_protocol`."""
