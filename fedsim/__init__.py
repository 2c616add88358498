"""Federated side: dropout-aware models and data, the Flower app (ServerApp with the curious
FedAvg, ClientApp), its run config, the capture store, and the ``fedsim`` command line."""
