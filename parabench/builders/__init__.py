"""The builders of the reference strategies: ``build(spec: TrainSpec) -> Trainer`` for each row of
``parabench.families`` whose implementation is in ``reference_impls``. The torch side of a family:
its row names the builder by import path, so reading the rows never imports this package.
"""
