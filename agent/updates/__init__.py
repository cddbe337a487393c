"""Model updates: the model store, verified downloads, trust in signed manifests, update jobs."""
