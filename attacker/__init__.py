"""Attacker side of the audit: the honest-but-curious server and its evaluation."""
