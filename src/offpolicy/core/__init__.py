"""The correction core: what turns a batch's log-probs into a corrected loss and its metrics, with no model, engine
or trainer in sight (docs/development.md, "Layout").

* the configuration (``config``, ``preset_data``, ``presets``) and its one error type (``errors``);
* the ratios and their statistics (``ops``, ``kl``, ``metrics``, ``sampling``, ``kept_set``, ``sequence_weight``);
* the correction (``correction``, ``thresholds``, ``step``, ``proximal``, ``centering``) and the loss (``losses``),
  with its kernels (``kernels``: reference, eager, compiled, Triton).

``import offpolicy as op`` re-exports the public names; everything here is importable as
``offpolicy.core.<module>``.
"""
