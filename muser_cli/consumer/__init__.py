"""The consumer's side: the machine the user sits at answers a request.

:mod:`muser_cli.consumer.lane`: the one lane every way of answering goes through (``muser
decode``, ``decode --serve``, ``muser batch``): a pack from a producer when one streams it, its
refusal by a gate blamed on that producer and the request computed here, the producer pool's
bookkeeping. :mod:`muser_cli.consumer.decode`: verify, bind, gate, install and decode one
request's rows (or prefill them here on the canonical schedule); :mod:`muser_cli.consumer.prompt_rows`:
those rows (a pack's, a delta merged with its stored base, or made here), a pack bound to the
prompt, the store keeping them. :mod:`muser_cli.consumer.pull`:
what a consumer asks a resident producer for, and the pull on a thread into decode's input.
:mod:`muser_cli.consumer.pool`: the producers a consumer may ask, least busy first, with
back-off and blame. :mod:`muser_cli.consumer.costs`: what each way of answering is expected to
cost, and the route; :mod:`muser_cli.consumer.cpushare` the share of its cores the engine gets,
:mod:`muser_cli.consumer.links` the probed link rates it starts from.

Nothing is imported here."""
