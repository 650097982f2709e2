"""Run the operator: `python -m gearshift.operator.reconcile --all-namespaces` (or --namespace NS).

Settings come from the environment (settings.py); the Kubernetes connection from the in-cluster
service account, or from KUBECONFIG outside a cluster.
"""

from __future__ import annotations

import argparse

import kopf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gearshift-operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", action="append", default=[], help="watch this namespace")
    scope.add_argument("--all-namespaces", action="store_true", help="watch the whole cluster")
    parser.add_argument("--liveness", default="", help="e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    from gearshift.operator.reconcile import handlers  # registers the handlers with kopf

    del handlers
    kopf.configure(verbose=args.verbose)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        standalone=True,  # one replica (the chart's Deployment uses Recreate); no peering CRD
    )


if __name__ == "__main__":
    main()
