"""Federated side: dropout-aware models, data, and (later) the Flower app and capture store."""
