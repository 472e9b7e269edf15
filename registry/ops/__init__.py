"""Operations: request ids, structured access logs, Prometheus metrics, liveness and readiness."""
