"""Shared test fixtures: throwaway servers live in fix_*.py plugins."""

pytest_plugins = ["fix_pg", "fix_mysql", "fix_spark", "fix_blocking", "fix_zk", "fix_tls"]
