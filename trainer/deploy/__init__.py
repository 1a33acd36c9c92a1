"""Deployment: the ``deploy`` config section, pod planning, Kubernetes Job rendering (``jobs/*.j2``) and
submission, topology checks shared with the Helm chart tests, and the container/`helm test` health checks."""
