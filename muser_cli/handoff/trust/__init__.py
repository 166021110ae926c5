"""Trust: who a node is and whom it believes -- its certificates (:mod:`.certs`), its
identity, keyring and onboarding verbs (:mod:`.node`, :mod:`.nodedir`, :mod:`.bundle`), and
the replay ledgers that make an id count once (:mod:`.ledger`)."""
