"""Grammar-constrained decoding (structured outputs), built on llguidance.

- `grammar`: a `StructuredOutput` spec (JSON schema, any JSON object, regex, choice,
  Lark grammar) -> an llguidance grammar, checked without a tokenizer (so a front end
  can refuse a bad spec before any work is queued).
- `matchers`: `GrammarMatchers`, the engine's per-request matcher state: compiled
  grammars cached by spec, one matcher per sequence advanced with each committed
  token (the scheduler's `TokenConstraints` hook), and the batch bitmask the runner
  hands the sampler.

Torch-free; the sampler turns the bitmask into a logit mask with torch ops.
"""
