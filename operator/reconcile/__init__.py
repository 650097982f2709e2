"""Kubernetes operator for InferenceDeployment: CRD, children rendering, kopf handlers."""
