"""Federated side: dropout-aware models and data, the Flower app (ServerApp with the curious
FedAvg, ClientApp), its run config, the capture store, and the ``fedsim`` command line."""

# Flower reads some of its environment when it is imported: every module of this package imports flwr
# only after this line has run, whichever module is imported first.
from . import flower_env

flower_env.apply()
