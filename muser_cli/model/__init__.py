"""Model facts, read without loading weights where they can be: where a model lives and its
fingerprints (resolve), what its config.json says about the cache (config), the facts every
layer above shares (info), its weights' headers (weights), its tokenizer (tokens), whether and
at what cost it moves (check), whether a pack is bound to this model, tokenizer and prompt
(binding), and the tiny random models the tests and demos build (tiny).

Nothing is imported here: ``muser_cli.model.info`` must stay cheap for the layers below the
engines, and the tokenizer pulls transformers."""
