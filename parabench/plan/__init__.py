"""``parabench plan``: a calibrated performance and memory model of a training configuration.

- ``model``: the physics. A ``Workload`` (shape x strategy and degrees x recipe x batch) and a
  ``Calibration`` (a few device constants) give a ``Prediction``: step time by part, tokens/s,
  MFU, peak memory per rank by part, communication bytes by kind. Imports no torch, so the report
  can predict a record from the record's own theory section.
- ``calibrate``: fits the constants from committed GPU records and the collectives suite.
- ``validate``: leave-one-configuration-out and out-of-scale checks of the fitted model.
- ``search``: enumerates the configurations of a model on N GPUs and ranks them.
"""
