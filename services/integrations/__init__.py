"""Optional bridges to the tools users bring (docs/integrations.md).

``records``  a study's trials as the platform stored them (config and metrics per evaluated step)
``optuna``   Optuna samplers as stagetree tuners, and export to an Optuna study (extra ``optuna``)
``mlflow``   one MLflow run per trial nested under a study run (extra ``mlflow``)
``tensorboard``  one TensorBoard event directory per trial (extra ``tensorboard``)

Each module imports its library at import time, so importing ``stagetree`` never needs them.
"""
