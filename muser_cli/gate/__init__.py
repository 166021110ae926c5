"""Every check a pack passes on the consumer's side before its first token: integrity and
structure (verify, which also runs the binding checks of :mod:`muser_cli.model.binding`), and the
numeric gate that recomputes positions from the pack's own rows (audit: the last N positions;
sampled: positions across the whole prompt; state: recurrent-state snapshots).

Nothing is imported here, so ``verify`` never pays for the engines the numeric gate needs."""
