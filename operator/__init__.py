"""kvscale.operator: the InferenceService CRD's controller (kopf) and its KV-occupancy autoscaler."""
